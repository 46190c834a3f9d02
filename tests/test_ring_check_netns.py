"""A node cut off on the workers' network is left out within 2 s of its round's close (issue 41).

Three real torchrun agents on a real etcd, each node in a network namespace of its own
(``elastic_ext.chaos.netns``: addresses only inside the lab's namespaces, behind a blackhole
route for their range in the root namespace). Node 2 reaches etcd but none of its peers
(``cut_peers``) from the start. Round 1 closes with all three; before any worker starts,
each node probes its ring neighbours (``ring_check.py``), the reports go with the joins of
round 2, and node 2 is left out: it exits 1 naming its address and interface. Before,
it was found only after the workers' first collective timed out (60 s in the trainer).
The workers are ``sleep``: nothing here waits on a collective.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ext.chaos import netns
from elastic_ext.local.job import JobSpec, LocalJob
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventKind

pytestmark = [pytest.mark.netns, pytest.mark.etcd, pytest.mark.slow, pytest.mark.quiet,
              pytest.mark.timeout(150)]

REASON = netns.unavailable()
LEFT_OUT_WITHIN_S = 2.0
CUT = 2  # the node cut off from its peers


def _state_note(job: LocalJob, text: str) -> dict[str, object] | None:
    """The first ``state`` event, of any node, whose note starts with ``text``."""
    notes = [e for node in job.nodes for e in node.events(EventKind.STATE)
             if str(e["note"]).startswith(text)]
    return min(notes, key=lambda e: float(e["time"]), default=None)


@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")
def test_a_node_its_peers_cannot_reach_is_left_out_within_two_seconds_of_its_rounds_close(
        tmp_path: Path) -> None:
    lab = netns.NetnsLab.allocate()
    spec = JobSpec(command=("sleep", "300"), nnodes="2:3", run_id="ring",
                   rdzv_conf="last_call_timeout=5,warm_start=off",
                   extra_torchrun_args=("--no-python",))
    job = LocalJob(spec, tmp_path, node_host=lab.node_host, store_host=lab.store_host,
                   store_call=lab.call_in_store)
    try:
        address = lab.node_host(CUT).address
        lab.cut_peers(CUT)  # etcd (the switch's .1) stays reachable
        job.start(3)
        cut = job.nodes[CUT]
        wait_until(lambda: cut.events(EventKind.EXCLUDED), 90, 0.1, "node 2 left out")
        closed = _state_note(job, "round 1 closed with 3 nodes")
        assert closed is not None, [n.events() for n in job.nodes]
        excluded = cut.events(EventKind.EXCLUDED)[0]
        took = float(excluded["time"]) - float(closed["time"])  # type: ignore[arg-type]
        print(f"left out {took:.2f}s after round 1 closed")
        assert 0 <= took <= LEFT_OUT_WITHIN_S, f"left out {took:.2f}s after its round closed"
        # the state's reason names the address when the node had joined round 2 by then;
        # its own message always does, with its interface
        assert "though the store was" in str(excluded["why"])
        assert cut.proc.wait(30) == 1
        message = str(excluded["message"])
        assert address in message and "interface eth0" in message \
            and "GLOO_SOCKET_IFNAME=eth0" in message, message
        assert "left out of the job" in cut.proc.output()
        wait_until(lambda: _state_note(job, "round 2 closed with 2 nodes"), 30, 0.1,
                   "round 2 with the other two")
        second = _state_note(job, "round 2 closed with 2 nodes")
        assert second is not None and "charged" not in str(second["note"])  # free
        formed = float(second["time"]) - float(closed["time"])  # type: ignore[arg-type]
        print(f"round 2 closed without it {formed:.2f}s after round 1 closed")
        told = [e for n in job.nodes[:CUT] for e in n.events(EventKind.UNREACHABLE)]
        assert told and all(e.get("before_start") for e in told), told
    finally:
        job.cleanup()
        lab.down()
