"""A worker's notice reaches the agent through a doorbell it waits on, not a poll: with
hundreds of agents on a machine, a look every 50 ms each was thousands of wake-ups a
second (issue 27)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.local.processes import wait_until
from elastic_ext.rendezvous.agent.events import EventLog
from elastic_ext.rendezvous.agent.notices import NoticeRelay
from elastic_ext.rendezvous.protocol.clock import SYSTEM_CLOCK
from elastic_ext.rendezvous.protocol.policy import Limits
from elastic_ext.worker.control import report_notice
from tests.support.memory_backend import MemoryBackend, MemoryStore

OLD_POLL_S = 0.05  # the watch this replaced looked this often


class _CountingControl(AgentControl):
    """An agent's control directory that counts how often the notice file is looked at."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.looks = 0

    def notice(self) -> str | None:
        self.looks += 1
        return super().notice()


def _watching_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "etcd-ext-notices"]


def _relay(control: AgentControl, woken: threading.Event) -> NoticeRelay:
    return NoticeRelay(MemoryBackend(MemoryStore()), "me", limits=Limits(1, 2, 1.0, None),
                       control=control, events=EventLog("run1", "me", "127.0.0.1", None),
                       clock=SYSTEM_CLOCK, wake=woken.set)


def test_a_workers_notice_wakes_the_agent_which_does_not_look_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = _CountingControl(tmp_path / "ctl")
    woken = threading.Event()
    relay = _relay(control, woken)
    relay.start()
    try:
        wait_until(lambda: control.looks, 5.0, 0.01, "the watch's first look")
        # Long enough for six looks of the old poll; a wait makes none.
        assert not woken.wait(6 * OLD_POLL_S)
        assert control.looks == 1

        monkeypatch.setenv(CONTROL_DIR_ENV, str(control.path))  # as in a worker
        assert report_notice("SIGUSR2 to a worker")
        assert woken.wait(5.0), "the notice did not wake the agent"
        assert control.looks == 2
        assert control.notice() == "SIGUSR2 to a worker"
        wait_until(lambda: not _watching_threads(), 5.0, 0.01, "the watch to end")
    finally:
        relay.close()


def test_closing_the_relay_ends_its_waiting_thread(tmp_path: Path) -> None:
    before = len(_watching_threads())
    control = AgentControl(tmp_path / "ctl")
    woken = threading.Event()
    relay = _relay(control, woken)
    relay.start()
    wait_until(lambda: len(_watching_threads()) > before, 5.0, 0.01, "the watch to start")
    relay.close()
    wait_until(lambda: len(_watching_threads()) == before, 5.0, 0.01, "the watch to end")
    assert not woken.is_set()


def test_a_notice_without_an_agent_waiting_is_still_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = AgentControl(tmp_path / "ctl")  # nobody reads its doorbell
    monkeypatch.setenv(CONTROL_DIR_ENV, str(control.path))
    assert report_notice("SIGTERM to a worker")  # never blocks on the FIFO
    assert control.notice() == "SIGTERM to a worker"
