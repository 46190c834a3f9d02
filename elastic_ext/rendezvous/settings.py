"""``--rdzv-conf`` and ``--rdzv-endpoint`` parsed into frozen settings, or a clear error.

Every accepted key is listed in ``CONF_KEYS`` (``conf_keys.py``); the README's configuration table
documents the same keys, and marks those torch's own backends share (``torch_conf``).
Parsing is pure (one deprecation warning aside) so it can be tested without a store.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ext.rendezvous.conf_keys import CONF_KEYS, DEFAULT_PASSWORD_ENV, RENAMED
from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.protocol.hang import HangRules
from elastic_ext.rendezvous.protocol.straggler import MODES as STRAGGLER_MODES
from elastic_ext.rendezvous.protocol.straggler import StragglerRules
from elastic_ext.rendezvous.torch_conf import ALIASES, TORCH_ONLY

logger = logging.getLogger(__name__)

DEFAULT_ETCD_PORT = 2379
DEFAULT_C10D_PORT = 29400
DEFAULT_INTERVAL_S = {"etcd": 1.0, "c10d": 0.5}
"""``heartbeat_interval`` by store: an etcd agent beats once a second (a request each, the
idle load of a job: issue 27), and learns of a death from a watch of the verdict, not at its
next beat; the embedded store has no watches, so its agents beat and look twice as often."""


_FORBIDDEN = {"password": "pass the password through `password_env` (an environment variable "
                          "name) or `password_file`, never on the command line"}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Timeouts:
    join: float = 600.0
    last_call: float = 1.0
    close: float = 10.0
    heartbeat_interval: float = 0.5
    heartbeat: float = 3.0
    request: float = 2.0
    connect: float = 15.0


@dataclass(frozen=True)
class TlsSettings:
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class Settings:
    store: str  # "etcd" or "c10d"
    endpoints: tuple[Endpoint, ...]  # etcd's members; c10d: its one host
    scheme: str  # "http" or "https" for etcd; "tcp" for c10d
    key_prefix: str
    run_id: str
    min_nodes: int
    max_nodes: int
    timeouts: Timeouts = Timeouts()
    tls: TlsSettings = TlsSettings()
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    max_restarts: int | None = None
    is_host: bool | None = None
    local_addr: str | None = None
    events_file: str | None = None
    metrics_port: int | None = None
    warm_start: bool = True
    warm_preload: tuple[str, ...] = ()
    heartbeat_mode: str = "write"  # or "lease" (etcd)
    reach_timeout: float = 0.75  # the ring check before the workers start (``reach.py``)
    hang: HangRules = HangRules()
    straggler: StragglerRules = StragglerRules()

    @property
    def run_prefix(self) -> str:
        return f"{self.key_prefix.rstrip('/')}/{self.run_id}/"

    def describe_endpoints(self) -> str:
        return ",".join(f"{self.scheme}://{ep}" for ep in self.endpoints)


def _number(key: str, raw: Any, *, minimum: float, integer: bool = False) -> float:
    try:
        value = int(str(raw)) if integer else float(str(raw))
    except ValueError:
        kind = "a whole number" if integer else "a number of seconds"
        raise ConfigError(f"--rdzv-conf {key}={raw!r} is not {kind}") from None
    if math.isnan(value) or math.isinf(value) or value < minimum:
        raise ConfigError(f"--rdzv-conf {key}={raw!r} must be a finite number >= {minimum}")
    return value


def _port(key: str, raw: Any) -> int:
    port = int(_number(key, raw, minimum=0, integer=True))
    if port > 65535:
        raise ConfigError(f"--rdzv-conf {key}={raw!r} must be a port, 0 to 65535")
    return port


def _bool_or_auto(key: str, raw: Any) -> bool | None:
    text = str(raw).strip().lower()
    if text in {"auto", ""}:
        return None
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"--rdzv-conf {key}={raw!r} must be true, false or auto")


def _on_off(key: str, raw: Any) -> bool:
    text = str(raw).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"--rdzv-conf {key}={raw!r} must be on or off")


_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _module_list(key: str, raw: str) -> tuple[str, ...]:
    """Module names separated by colons (what torchrun's ``--rdzv-conf`` parser lets
    through: it splits at every comma) or by commas (a configuration given in Python)."""
    names = tuple(name.strip() for name in re.split(r"[:,]", raw) if name.strip())
    for name in names:
        if not _MODULE_RE.match(name):
            raise ConfigError(f"--rdzv-conf {key}: {name!r} is not a module name; give dotted "
                              "names separated by colons, e.g. numpy:mypackage.model")
    return names


_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_endpoints(text: str, default_port: int) -> tuple[str | None, tuple[Endpoint, ...]]:
    """``'etcd://a:1,b'`` -> (``'etcd'``, endpoints); the scheme is None when absent."""
    text = text.strip()
    scheme = None
    if "://" in text:
        scheme, text = text.split("://", 1)
        scheme = scheme.lower()
    endpoints = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        item = re.sub(r"^[a-z0-9]+://", "", item).rstrip("/")
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        else:
            host, port_text = item, ""
        if not host or not (_HOST_RE.match(host) or ":" in host):
            raise ConfigError(f"--rdzv-endpoint entry {item!r} is not HOST[:PORT]")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ConfigError(
                f"--rdzv-endpoint entry {item!r} has a port that is not a number") from None
        if not 0 < port < 65536:
            raise ConfigError(f"--rdzv-endpoint entry {item!r}: port {port} is outside 1-65535")
        endpoints.append(Endpoint(host, port))
    return scheme, tuple(endpoints)


def _check_one_c10d_host(endpoints: tuple[Endpoint, ...]) -> None:
    """The embedded store lives in one agent: a list of hosts would promise a failover
    it does not have. High availability is etcd's, so the error points there."""
    if len(endpoints) > 1:
        listed = "c10d://" + ",".join(str(e) for e in endpoints)
        raise ConfigError(
            f"--rdzv-endpoint={listed} names {len(endpoints)} hosts, but the embedded c10d "
            "store has one host (c10d://HOST:PORT) and dies with it; for a store that survives "
            "a node use etcd: a 3-member cluster (deploy/local/etcd-cluster.sh, deploy/slurm/, "
            "deploy/k8s/) and --rdzv-endpoint=host1:2379,host2:2379,host3:2379")


def _read_password(conf: Mapping[str, Any], user: str | None) -> str | None:
    if not user:
        return None
    if conf.get("password_file"):
        path = Path(str(conf["password_file"]))
        try:
            return path.read_text().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigError(f"--rdzv-conf password_file={path}: cannot read a password "
                              f"from it ({exc})") from exc
    env_name = str(conf.get("password_env") or DEFAULT_PASSWORD_ENV)
    if env_name not in os.environ:
        raise ConfigError(f"--rdzv-conf user={user} needs a password: set the environment "
                          f"variable {env_name} or give password_file")
    return os.environ[env_name]


def _same_value(a: Any, b: Any) -> bool:
    """Two values of one key, compared as numbers where both are ("1" and "1.0" agree)."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def _our_names(conf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``conf`` under etcd-ext's own key names, and for each key the name the user wrote
    it under (errors quote it): an old name (``RENAMED``) works and says once what to
    write instead; torch's name for a key (``ALIASES``) works as it is."""
    ours, written = dict(conf), {key: key for key in conf}
    for old, new in RENAMED.items():
        if old not in conf:
            continue
        if new in conf:
            raise ConfigError(f"--rdzv-conf {old} and {new} are both given; {old} is the old "
                              f"name of {new}: give only {new}")
        logger.warning("--rdzv-conf %s=%s is deprecated: write %s=%s (the same setting)",
                       old, conf[old], new, conf[old])
        ours[new], written[new] = ours.pop(old), old
    for alias, key in ALIASES.items():
        if alias not in conf:
            continue
        if key in conf and not _same_value(conf[key], conf[alias]):
            raise ConfigError(f"--rdzv-conf {key}={conf[key]} and {alias}={conf[alias]} "
                              f"disagree; {alias} is torch's name for {key}: give one of them")
        ours[key], written[key] = ours.pop(alias), alias
    return ours, written


def parse_settings(*, endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
                   conf: Mapping[str, Any], local_addr: str | None = None,
                   default_max_restarts: int | None = None) -> Settings:
    """Validate everything up front so a bad flag fails before any node waits."""
    for key in conf:
        if key in _FORBIDDEN:
            raise ConfigError(f"--rdzv-conf {key}=... is not accepted: {_FORBIDDEN[key]}")
        if key in TORCH_ONLY:
            raise ConfigError(f"--rdzv-conf {key} is a key of torch's own rendezvous backends "
                              f"that etcd-ext does not read: {TORCH_ONLY[key]}")
        if key not in CONF_KEYS and key not in ALIASES and key not in RENAMED:
            raise ConfigError(f"unknown --rdzv-conf key {key!r}; etcd-ext accepts: "
                              + ", ".join(sorted({*CONF_KEYS, *ALIASES})))
    conf, written = _our_names(conf)
    mode_key = written.get("heartbeat_mode", "heartbeat_mode")
    if min_nodes < 1 or max_nodes < min_nodes:
        raise ConfigError(f"--nnodes={min_nodes}:{max_nodes} is not a range: use MIN:MAX with "
                          "1 <= MIN <= MAX, e.g. --nnodes=2:4")
    if not run_id or not re.match(r"^[A-Za-z0-9_.\-]+$", run_id):
        raise ConfigError(f"--rdzv-id={run_id!r}: use letters, digits, '.', '_' and '-' only")

    store = str(conf.get("store", "auto")).lower()
    if store not in {"auto", "etcd", "c10d"}:
        raise ConfigError(f"--rdzv-conf store={store!r} must be etcd, c10d or auto")
    scheme_hint = endpoint.strip().split("://", 1)[0].lower() if "://" in endpoint else None
    if store == "auto":
        store = "c10d" if (not endpoint.strip() or scheme_hint == "c10d") else "etcd"
    default_port = DEFAULT_C10D_PORT if store == "c10d" else DEFAULT_ETCD_PORT
    scheme, endpoints = parse_endpoints(endpoint, default_port)
    tls = TlsSettings(cacert=conf.get("cacert") or None, cert=conf.get("cert") or None,
                      key=conf.get("key") or None)
    if bool(tls.cert) != bool(tls.key):
        raise ConfigError("--rdzv-conf cert and key go together: give both or neither")
    for name in ("cacert", "cert", "key"):
        path = getattr(tls, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"--rdzv-conf {name}={path}: no such file")

    if store == "c10d":
        if scheme not in {None, "c10d", "tcp"}:
            raise ConfigError(f"store c10d takes a c10d://HOST:PORT endpoint, not {scheme}://")
        endpoints = endpoints or (Endpoint("127.0.0.1", DEFAULT_C10D_PORT),)
        _check_one_c10d_host(endpoints)
        wire_scheme = "tcp"
    else:
        if scheme not in {None, "etcd", "http", "https", "etcds"}:
            raise ConfigError(f"--rdzv-endpoint scheme {scheme}:// is not etcd://, http:// or https://")
        if not endpoints:
            raise ConfigError("store etcd needs --rdzv-endpoint=HOST:PORT[,HOST:PORT...] "
                              "(or leave the endpoint empty to use the embedded c10d store)")
        secure = scheme in {"https", "etcds"} or tls.cacert or tls.cert
        wire_scheme = "https" if secure else "http"

    join = conf.get("join_timeout", conf.get("timeout", 600))
    timeouts = Timeouts(
        join=_number("join_timeout", join, minimum=1),
        last_call=_number("last_call_timeout", conf.get("last_call_timeout", 1.0), minimum=0),
        close=_number("close_timeout", conf.get("close_timeout", 10), minimum=0.1),
        heartbeat_interval=_number(written.get("heartbeat_interval", "heartbeat_interval"),
                                   conf.get("heartbeat_interval", DEFAULT_INTERVAL_S[store]),
                                   minimum=0.05),
        heartbeat=_number("heartbeat_timeout", conf.get("heartbeat_timeout", 3.0), minimum=0.2),
        request=_number("request_timeout", conf.get("request_timeout", 2.0), minimum=0.05),
        connect=_number("connect_timeout", conf.get("connect_timeout", 15), minimum=0.1),
    )
    if timeouts.heartbeat < 2 * timeouts.heartbeat_interval:
        raise ConfigError(f"--rdzv-conf heartbeat_timeout={timeouts.heartbeat} must be at least "
                          f"twice heartbeat_interval={timeouts.heartbeat_interval}")
    if timeouts.heartbeat > timeouts.join:
        raise ConfigError("--rdzv-conf heartbeat_timeout must not exceed join_timeout")

    heartbeat_mode = str(conf.get("heartbeat_mode", "write")).lower()
    if heartbeat_mode not in {"write", "lease"}:
        raise ConfigError(f"--rdzv-conf {mode_key}={heartbeat_mode!r} must be write or lease")
    if heartbeat_mode == "lease" and store != "etcd":
        raise ConfigError(f"--rdzv-conf {mode_key}=lease needs etcd (the embedded store has no "
                          f"leases); use {mode_key}=write")

    max_restarts = default_max_restarts
    if "max_restarts" in conf:
        max_restarts = int(_number("max_restarts", conf["max_restarts"], minimum=0, integer=True))
    user = str(conf["user"]) if conf.get("user") else None
    key_prefix = str(conf.get("key_prefix", "/elastic-ext"))
    if not key_prefix.startswith("/") or "//" in key_prefix or len(key_prefix) > 200:
        raise ConfigError(f"--rdzv-conf key_prefix={key_prefix!r} must be an absolute key path "
                          "like /elastic-ext")
    return Settings(
        store=store, endpoints=endpoints, scheme=wire_scheme, key_prefix=key_prefix,
        run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, timeouts=timeouts, tls=tls,
        user=user, password=_read_password(conf, user), max_restarts=max_restarts,
        is_host=_bool_or_auto("is_host", conf.get("is_host", "auto")), local_addr=local_addr,
        events_file=str(conf["events_file"]) if conf.get("events_file") else None,
        metrics_port=_port("metrics_port", conf["metrics_port"])
        if str(conf.get("metrics_port", "")).strip() else None,
        warm_start=_on_off("warm_start", conf.get("warm_start", "on")),
        reach_timeout=_number("reach_timeout", conf.get("reach_timeout", 0.75), minimum=0),
        warm_preload=_module_list("warm_preload", str(conf.get("warm_preload", ""))),
        heartbeat_mode=heartbeat_mode,
        hang=HangRules(floor=_number("hang_floor", conf.get("hang_floor", 2.0), minimum=0.1),
                       factor=_number("hang_factor", conf.get("hang_factor", 10), minimum=1),
                       startup=_number("hang_startup", conf.get("hang_startup", 300),
                                       minimum=1),
                       busy=_number("hang_busy", conf.get("hang_busy", 60), minimum=1),
                       peers_judged=timeouts.heartbeat + timeouts.heartbeat_interval + 0.5,
                       enabled=_on_off("hang_check", conf.get("hang_check", "on"))),
        straggler=_straggler_rules(conf),
    )


def _straggler_rules(conf: dict[str, Any]) -> StragglerRules:
    mode = str(conf.get("straggler", "warn")).strip().lower()
    if mode not in STRAGGLER_MODES:
        raise ConfigError(f"--rdzv-conf straggler={mode!r} must be one of "
                          f"{', '.join(STRAGGLER_MODES)}")
    return StragglerRules(
        mode=mode, margin=_number("straggler_margin", conf.get("straggler_margin", 1.5),
                                  minimum=1.05),
        for_s=_number("straggler_for", conf.get("straggler_for", 30), minimum=1))
