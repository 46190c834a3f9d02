"""The one hold after a fault that is not the worker's own (``elastic_ext.worker.hold``), which the
bundled trainer's guard and the warm-start launcher's worker both go through."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.worker import hold
from elastic_ext.worker.hold import (
    EXIT_HOLD_TIMEOUT,
    hold_after_peer_fault,
    hold_for_agent,
    is_peer_fault,
)
from elastic_ext.worker.preemption import GuardSettings, PreemptionGuard

PEER_FAULT = RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer")


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AgentControl:
    ctl = AgentControl(tmp_path / "ctl")
    monkeypatch.setenv(CONTROL_DIR_ENV, str(ctl.path))
    monkeypatch.setenv("RANK", "3")
    ctl.publish_round(2)
    return ctl


def never(timeout: float) -> int | None:
    time.sleep(timeout)
    return None


def test_without_an_agent_nothing_is_reported_and_nobody_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONTROL_DIR_ENV, raising=False)
    calls: list[float] = []

    def wait(timeout: float) -> int | None:
        calls.append(timeout)
        return None

    assert hold_for_agent("x", wait=wait) is None
    assert hold_after_peer_fault(PEER_FAULT, wait=wait) is None
    assert calls == []


def test_the_report_then_the_agents_signal_gives_the_exit_status(agent: AgentControl) -> None:
    order: list[str] = []

    def wait(timeout: float) -> int | None:
        order.append("wait")
        assert timeout <= 0.2  # the agent's life is looked at between waits
        return signal.SIGTERM if len(order) > 2 else None

    code = hold_after_peer_fault(PEER_FAULT, wait=wait, on_reported=lambda: order.append("kept"))
    assert code == 128 + signal.SIGTERM
    assert order == ["kept", "wait", "wait"]
    assert agent.fault_reported(2) == f"rank 3: RuntimeError: {PEER_FAULT}"
    assert agent.setup_fault_reported(2) is None


def test_a_setup_fault_is_reported_as_one(agent: AgentControl) -> None:
    assert hold_for_agent("the server died", setup_fault=True,
                          wait=lambda t: signal.SIGINT) == 128 + signal.SIGINT
    assert agent.setup_fault_reported(2) == "rank 3: the server died"
    assert agent.fault_reported(2) is None


def test_an_agent_that_never_stops_the_worker_or_dies_gets_a_non_zero_exit(
        agent: AgentControl, monkeypatch: pytest.MonkeyPatch) -> None:
    began = time.monotonic()
    assert hold_for_agent("x", timeout_s=0.5, wait=never) == EXIT_HOLD_TIMEOUT
    assert 0.5 <= time.monotonic() - began < 2
    parents = iter([100, 100, 1])  # the agent (our parent) dies: we are reparented
    monkeypatch.setattr(hold.os, "getppid", lambda: next(parents))
    began = time.monotonic()
    assert hold_for_agent("x", timeout_s=30, wait=never) == EXIT_HOLD_TIMEOUT
    assert time.monotonic() - began < 2


def test_only_a_process_that_ran_collectives_has_peer_faults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_peer_fault(ConnectionResetError()) and is_peer_fault(PEER_FAULT)
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert not is_peer_fault(ConnectionResetError()) and not is_peer_fault(PEER_FAULT)


@pytest.fixture
def sigusr2_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        yield
    finally:
        while signal.sigtimedwait({signal.SIGUSR2}, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@pytest.mark.usefixtures("sigusr2_blocked")
def test_a_process_without_handlers_takes_the_stop_signal_blocked() -> None:
    assert hold.wait_blocked(0.01) is None
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)  # pending: blocked
    assert hold.wait_blocked(1.0) == signal.SIGUSR2


def test_the_guard_holds_the_same_way(agent: AgentControl,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Its keep runs once the fault is reported; an agent that dies ends the hold at once."""
    kept: list[str] = []
    guard = PreemptionGuard(GuardSettings(hold_timeout_s=30),
                            keep_state=lambda why: kept.append(guard.phase.value))
    parents = iter([100, 1])
    monkeypatch.setattr(hold.os, "getppid", lambda: next(parents, 1))
    began = time.monotonic()
    assert guard.failure_exit_code(PEER_FAULT) == EXIT_HOLD_TIMEOUT
    assert time.monotonic() - began < 2
    assert kept == ["committing"] and guard.phase.value == "holding"
    assert agent.fault_reported(2) == f"rank 3: RuntimeError: {PEER_FAULT}"
    with pytest.raises(ValueError):  # not a peer's fault: raised again, nothing held
        PreemptionGuard().failure_exit_code(ValueError("bad value"))
