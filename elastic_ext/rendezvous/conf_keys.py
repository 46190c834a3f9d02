"""Every ``--rdzv-conf`` key etcd-ext accepts, with its default and meaning: the README's
configuration table is checked against the same text (``tests/test_docs.py``), and
``settings.py`` parses them."""

from __future__ import annotations

DEFAULT_PASSWORD_ENV = "ELASTIC_EXT_ETCD_PASSWORD"

# key -> (default, meaning). The README table is generated from the same text.
CONF_KEYS: dict[str, tuple[str, str]] = {
    "store": ("auto", "`etcd`, `c10d` (embedded TCPStore) or `auto`: `c10d` when the endpoint "
                      "is empty or starts with `c10d://`, else `etcd`"),
    "key_prefix": ("/elastic-ext", "the run's keys live under `<key_prefix>/<run_id>/`"),
    "join_timeout": ("600", "seconds a node waits for a round to admit it (below `--nnodes` MIN "
                            "included) before it exits; torchrun's `--rdzv-timeout` sets it too"),
    "last_call_timeout": ("1.0", "seconds a round with at least MIN nodes waits for live members "
                                 "that have not rejoined yet; it closes at once when all have"),
    "close_timeout": ("10", "seconds `shutdown` and `set_closed` keep trying to reach the store"),
    "heartbeat_interval": ("1.0 on etcd, 0.5 embedded",
                           "seconds between an agent's heartbeats (on etcd a watch of the "
                           "watcher's verdict tells every agent of a death at once; the "
                           "embedded store's agents read it at their next heartbeat)"),
    "heartbeat_timeout": ("3.0", "a node whose heartbeat has not changed for this long is dead"),
    "heartbeat_mode": ("write", "`write`: each agent writes its heartbeat every interval; "
                                "`lease` (etcd only): it renews an etcd lease instead and the "
                                "others watch its key (fewer requests; see "
                                "docs/failure-model.md); `heartbeat`, its old name, still "
                                "works, with a warning"),
    "request_timeout": ("2.0", "seconds one etcd request may take before the next endpoint "
                               "is tried; a slower etcd lengthens it (4× its slowest recent "
                               "answer, up to `connect_timeout`)"),
    "connect_timeout": ("15", "seconds one store operation keeps retrying across endpoints; "
                              "an agent that cannot reach etcd at start fails after this with "
                              "the endpoints named (inside a rendezvous an etcd outage is "
                              "waited out until `join_timeout`)"),
    "max_restarts": ("torchrun's `--max-restarts`",
                     "job-wide budget of worker-failure restarts, kept in the store; "
                     "membership changes are free"),
    "cacert": ("", "CA bundle that signed etcd's server certificate (turns on https)"),
    "cert": ("", "client certificate for etcd mutual TLS (needs `key`)"),
    "key": ("", "private key of `cert`"),
    "user": ("", "etcd user name; its password comes from `password_env` or `password_file`"),
    "password_env": (DEFAULT_PASSWORD_ENV, "environment variable that holds the etcd password"),
    "password_file": ("", "file whose first line is the etcd password"),
    "is_host": ("auto", "c10d store only: whether this node hosts the embedded TCPStore "
                        "(`auto`: the node whose address matches the endpoint tries; `true`: "
                        "this node hosts; `false`: it only connects)"),
    "events_file": ("", "append one JSON line per rendezvous event of this agent to this file "
                        "(for tools and audits; see `elastic_ext/rendezvous/agent/events.py`)"),
    "metrics_port": ("", "serve this agent's Prometheus metrics on this port of every "
                         "interface (`0`: any free port, named in the log and the "
                         "`started` event); needs `pip install 'elastic-ext[metrics]'`"),
    "warm_start": ("on", "`on` or `off`: a per-node fork server starts the workers of "
                         "`-m elastic_ext.warm ...` and of the bundled `-m trainer` in a "
                         "fraction of a second (see `docs/warm-start.md`)"),
    "warm_preload": ("", "extra modules, separated by colons, the warm-start server imports "
                         "before it forks workers"),
    "hang_check": ("on", "`on` or `off`: a round whose workers finish no step for "
                         "max(`hang_floor`, `hang_factor` x their recent step time) is hung: "
                         "its stuck workers are killed and a new round starts from the kept "
                         "step (workers that report steps: `ElasticLoop`, the bundled "
                         "trainer, the HF and Lightning callbacks)"),
    "hang_floor": ("2.0", "seconds without a finished step that are never a hang"),
    "hang_factor": ("10", "how many recent step times without a finished step make a hang"),
    "hang_busy": ("60", "seconds without a finished step after which a gloo node whose "
                        "workers all run outside collectives (an evaluation not in "
                        "`no_hang_check()`, or a stuck rank of a one-worker node) is hung"),
    "hang_startup": ("300", "seconds a round's first two steps may take (restore, "
                            "compilation, the first batches) before it is hung"),
    "straggler": ("warn", "`off`, `warn` or `drop`: a node whose own step work (DDP's "
                          "compute, without the wait for the others) takes `straggler_margin` "
                          "x the other nodes' for `straggler_for` seconds is named in an event "
                          "and `elastic-ext status`; `drop` also leaves it out at the next "
                          "step boundary, free, when the others would train more samples per "
                          "second without it and `--nnodes` MIN allows"),
    "straggler_margin": ("1.5", "how many times the other nodes' own step time makes a node "
                                "slow"),
    "straggler_for": ("30", "seconds a node stays slow before it is named (and dropped)"),
    "reach_timeout": ("0.75", "seconds a node spends at most, when its round closes and "
                              "before its workers start, connecting to its ring neighbours "
                              "at the addresses they publish for their workers; a node most "
                              "of its probers cannot reach is left out (`0`: no check)"),
    "timeout": ("900", "set by torchrun from `--rdzv-timeout`; used as `join_timeout` "
                       "when that key is not given"),
}

RENAMED: dict[str, str] = {"heartbeat": "heartbeat_mode"}
"""Old name -> new name: still accepted, with one warning, so existing jobs keep running."""
