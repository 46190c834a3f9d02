"""--rdzv-conf and --rdzv-endpoint parsing: defaults, store choice, and clear errors."""

import logging
import re

import pytest

from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.settings import CONF_KEYS, parse_settings
from elastic_ext.rendezvous.torch_conf import ALIASES, TORCH_KEYS


def parse(endpoint="127.0.0.1:2379", conf=None, nnodes=(1, 2), **kw):
    return parse_settings(endpoint=endpoint, run_id="job1", min_nodes=nnodes[0],
                          max_nodes=nnodes[1], conf=conf or {}, **kw)


def test_defaults_use_etcd_with_the_documented_prefix_and_timeouts():
    s = parse()
    assert s.store == "etcd" and s.scheme == "http"
    assert s.run_prefix == "/elastic-ext/job1/"
    assert ((s.timeouts.last_call, s.timeouts.heartbeat_interval, s.timeouts.heartbeat)
            == (1.0, 1.0, 3.0))
    assert parse(endpoint="").timeouts.heartbeat_interval == 0.5  # the embedded store


def test_empty_endpoint_selects_the_embedded_store_on_the_default_port():
    s = parse(endpoint="")
    assert s.store == "c10d" and str(s.endpoints[0]) == "127.0.0.1:29400"


def test_c10d_scheme_or_conf_key_selects_the_embedded_store():
    assert parse(endpoint="c10d://node1:1234").store == "c10d"
    assert parse(endpoint="node1:1234", conf={"store": "c10d"}).store == "c10d"


def test_endpoint_list_keeps_order_and_fills_default_ports():
    s = parse(endpoint="etcd://a:1,b,[::1]:3")
    assert [str(e) for e in s.endpoints] == ["a:1", "b:2379", "[::1]:3"]


def test_https_scheme_or_a_ca_turns_on_tls(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert parse(endpoint="https://a:1").scheme == "https"
    assert parse(conf={"cacert": str(ca)}).scheme == "https"


def test_torchrun_timeout_is_the_join_timeout_unless_join_timeout_is_given():
    assert parse(conf={"timeout": "900"}).timeouts.join == 900
    assert parse(conf={"timeout": "900", "join_timeout": "30"}).timeouts.join == 30


def test_unknown_key_is_named_and_the_accepted_keys_listed():
    with pytest.raises(ConfigError,
                       match=r"unknown --rdzv-conf key 'heartbeats'.*heartbeat_interval"):
        parse(conf={"heartbeats": "1"})


def test_the_unknown_key_error_lists_every_accepted_key_the_alias_but_not_the_old_name():
    with pytest.raises(ConfigError) as info:
        parse(conf={"heartbeat_modus": "lease"})
    accepted = str(info.value).split("etcd-ext accepts: ", 1)[1].split(", ")
    assert accepted == sorted({*CONF_KEYS, *ALIASES})
    assert "heartbeat_mode" in accepted and "keep_alive_interval" in accepted
    assert "heartbeat" not in accepted  # still read, no longer advertised


def test_the_heartbeat_mode_is_write_or_lease_and_lease_needs_etcd():
    assert parse().heartbeat_mode == "write"
    assert parse(conf={"heartbeat_mode": "lease"}).heartbeat_mode == "lease"
    assert parse(conf={"heartbeat_mode": "LEASE"}).heartbeat_mode == "lease"
    with pytest.raises(ConfigError, match="heartbeat_mode='beat' must be write or lease"):
        parse(conf={"heartbeat_mode": "beat"})
    with pytest.raises(ConfigError,
                       match="heartbeat_mode=lease needs etcd.*use heartbeat_mode=write"):
        parse_settings(endpoint="c10d://127.0.0.1:29400", run_id="r", min_nodes=1,
                       max_nodes=2, conf={"heartbeat_mode": "lease"})


def test_the_old_heartbeat_key_still_works_with_one_deprecation_line(caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_ext.rendezvous.settings"):
        assert parse(conf={"heartbeat": "lease"}).heartbeat_mode == "lease"
    lines = [r for r in caplog.records if r.name == "elastic_ext.rendezvous.settings"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "heartbeat=lease is deprecated: write heartbeat_mode=lease" in lines[0].getMessage()
    caplog.clear()
    parse(conf={"heartbeat_mode": "lease"})
    assert not [r for r in caplog.records if r.name == "elastic_ext.rendezvous.settings"]
    # its errors quote the key the user wrote
    with pytest.raises(ConfigError, match="heartbeat='beat' must be write or lease"):
        parse(conf={"heartbeat": "beat"})
    with pytest.raises(ConfigError, match="heartbeat=lease needs etcd.*use heartbeat=write"):
        parse(endpoint="", conf={"heartbeat": "lease"})


@pytest.mark.parametrize("old", ["write", "lease"])
def test_the_old_and_the_new_heartbeat_key_together_are_refused_naming_both(old):
    with pytest.raises(ConfigError, match="heartbeat and heartbeat_mode are both given; "
                                          "heartbeat is the old name of heartbeat_mode: "
                                          "give only heartbeat_mode"):
        parse(conf={"heartbeat": old, "heartbeat_mode": "lease"})


def test_torchs_keep_alive_interval_is_the_heartbeat_interval():
    assert parse(conf={"keep_alive_interval": "0.5"}).timeouts.heartbeat_interval == 0.5
    agree = {"keep_alive_interval": "2", "heartbeat_interval": "2.0", "heartbeat_timeout": "6"}
    assert parse(conf=agree).timeouts.heartbeat_interval == 2.0
    with pytest.raises(ConfigError, match="heartbeat_interval=1 and keep_alive_interval=2 "
                                          "disagree; keep_alive_interval is torch's name for "
                                          "heartbeat_interval: give one of them"):
        parse(conf={"heartbeat_interval": "1", "keep_alive_interval": "2",
                    "heartbeat_timeout": "6"})
    with pytest.raises(ConfigError, match="keep_alive_interval='0' must be a finite number"):
        parse(conf={"keep_alive_interval": "0"})


@pytest.mark.parametrize("key,instead", [
    ("keep_alive_max_attempt", "give heartbeat_timeout=SECONDS instead"),
    ("read_timeout", "give request_timeout"), ("protocol", "https:// endpoint or cacert"),
    ("ca_cert", "give cacert instead"), ("ssl_cert", "give cert instead"),
    ("ssl_cert_key", "give key instead"), ("etcd_prefix", "give key_prefix instead"),
    ("store_type", "give store=etcd, c10d or auto instead"),
])
def test_torch_keys_etcd_ext_does_not_read_are_refused_naming_what_to_give(key, instead):
    with pytest.raises(ConfigError, match=f"--rdzv-conf {key} is a key of torch's own "
                                          f"rendezvous backends that etcd-ext does not read: "
                                          f".*{re.escape(instead)}"):
        parse(conf={key: "3"})


def test_the_torch_column_names_only_keys_we_accept():
    assert set(TORCH_KEYS) <= set(CONF_KEYS)
    assert set(ALIASES.values()) <= set(CONF_KEYS) and not set(ALIASES) & set(CONF_KEYS)
    assert all(f"`{alias}`" in TORCH_KEYS[key] for alias, key in ALIASES.items())


def test_password_on_the_command_line_is_refused():
    with pytest.raises(ConfigError, match="password_env"):
        parse(conf={"password": "hunter2"})


def test_user_without_a_password_source_names_the_variable(monkeypatch):
    monkeypatch.delenv("ELASTIC_EXT_ETCD_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="ELASTIC_EXT_ETCD_PASSWORD"):
        parse(conf={"user": "alice"})


def test_password_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("PW", "s3cret")
    assert parse(conf={"user": "alice", "password_env": "PW"}).password == "s3cret"
    f = tmp_path / "pw"
    f.write_text("fromfile\n")
    assert parse(conf={"user": "alice", "password_file": str(f)}).password == "fromfile"
    assert "s3cret" not in repr(parse(conf={"user": "alice", "password_env": "PW"}))


@pytest.mark.parametrize("key,value", [
    ("join_timeout", "-5"), ("last_call_timeout", "soon"), ("heartbeat_timeout", "nan"),
    ("heartbeat_interval", "0"), ("max_restarts", "-1"), ("request_timeout", "inf"),
])
def test_absurd_values_are_rejected_with_the_key_named(key, value):
    with pytest.raises(ConfigError, match=key):
        parse(conf={key: value})


def test_heartbeat_timeout_must_leave_room_for_two_beats():
    with pytest.raises(ConfigError, match="twice heartbeat_interval"):
        parse(conf={"heartbeat_interval": "1", "heartbeat_timeout": "1.5"})


@pytest.mark.parametrize("nnodes", [(3, 2), (0, 2)])
def test_nnodes_range_must_be_min_le_max(nnodes):
    with pytest.raises(ConfigError, match="--nnodes"):
        parse(nnodes=nnodes)


@pytest.mark.parametrize("endpoint,match", [
    ("bad host!:1", "not HOST"), ("host:99999", "outside 1-65535"), ("host:http", "not a number"),
    ("ftp://a:1", "scheme"), ("c10d://a:1,b:2", "embedded c10d store has one host"),
])
def test_malformed_endpoints_are_rejected(endpoint, match):
    with pytest.raises(ConfigError, match=match):
        parse(endpoint=endpoint)


def test_cert_without_key_is_rejected(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="cert and key go together"):
        parse(conf={"cert": str(cert)})


def test_missing_tls_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cacert=.*no such file"):
        parse(conf={"cacert": str(tmp_path / "nope.pem")})


def test_max_restarts_defaults_to_torchruns_and_conf_overrides():
    assert parse(default_max_restarts=3).max_restarts == 3
    assert parse(conf={"max_restarts": "5"}, default_max_restarts=3).max_restarts == 5


def test_every_key_has_a_default_and_a_meaning_for_the_readme():
    assert all(default is not None and meaning for default, meaning in CONF_KEYS.values())
