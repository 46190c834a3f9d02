"""The torch internals etcd-ext relies on (``elastic_ext.torch_compat``), checked against the
installed torch: an upgrade that removes or changes one fails here, naming it."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from elastic_ext import torch_compat


def _resolve(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"torch internal {dotted} is gone ({exc}); update elastic_ext/torch_compat.py")


def test_launch_agent_shuts_the_handler_down_in_finally_after_a_child_failure() -> None:
    source = inspect.getsource(_resolve(torch_compat.LAUNCH_AGENT))
    raises = source.find("raise ChildFailedError(")
    finally_ = source.find("finally:")
    shutdown = source.find("rdzv_handler.shutdown()", finally_)
    assert -1 < raises < finally_ < shutdown, (
        f"{torch_compat.LAUNCH_AGENT} no longer raises ChildFailedError and then calls "
        "rdzv_handler.shutdown() in its finally: agent_gave_up() cannot see the failure")


def test_agent_gave_up_sees_a_child_failure_in_flight_and_nothing_else() -> None:
    assert not torch_compat.agent_gave_up()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")
    try:
        raise ChildFailedError("trainer", {0: failure})
    except ChildFailedError:
        assert torch_compat.agent_gave_up()
    try:
        raise RuntimeError("something else")
    except RuntimeError:
        assert not torch_compat.agent_gave_up()


def test_torchruns_parser_still_reads_max_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolve(torch_compat.ARGS_PARSER)
    argv = ["/usr/bin/torchrun", "--nnodes=1:2", "--max-restarts=5", "train.py"]
    assert torch_compat.torchrun_max_restarts(argv) == 5, (
        f"{torch_compat.ARGS_PARSER} no longer parses --max-restarts")
    assert torch_compat.torchrun_max_restarts(["/x/torch/distributed/run.py", "t.py"]) == 0
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    assert torch_compat.torchrun_max_restarts(["torchrun", "t.py"]) == 7
    assert torch_compat.torchrun_max_restarts(["python", "-m", "pytest"]) is None
    assert torch_compat.torchrun_max_restarts(["torchrun", "--no-such-flag"]) is None


@pytest.mark.parametrize(("command", "workers"), [
    (["-m", "elastic_ext.warm", "train.py", "--lr", "1"],
     torch_compat.WorkerCommand(module=True, script="elastic_ext.warm",
                                args=("train.py", "--lr", "1"))),
    (["train.py", "--lr", "1"],
     torch_compat.WorkerCommand(module=False, script="train.py", args=("--lr", "1"))),
    (["--no-python", "bash", "run.sh"], None),
])
def test_the_budget_and_the_workers_are_read_from_torchs_agent_whatever_started_it(
        monkeypatch: pytest.MonkeyPatch, command: list[str],
        workers: torch_compat.WorkerCommand | None) -> None:
    """``accelerate launch`` runs torch's ``run(args)`` in its own process, so ``sys.argv``
    is accelerate's: the handler reads the agent's budget and workers from the
    ``LAUNCH_AGENT`` frame it is built in (here the real one, in-process, with a probe
    backend that records what it reads and stops the launch)."""
    import uuid

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import get_args_parser, run

    class Probed(Exception):
        pass

    seen: dict[str, object] = {}

    def probe(params: Any) -> Any:
        seen["max_restarts"] = torch_compat.torchrun_max_restarts()
        seen["workers"] = torch_compat.torchrun_worker_command()
        raise Probed

    backend = f"compat-probe-{uuid.uuid4().hex[:8]}"
    rendezvous_handler_registry.register(backend, probe)
    for name in ("TORCHELASTIC_SIGNALS_TO_HANDLE", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # run() sets them; restored after
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/accelerate", "launch", "--multi_gpu"])
    args = get_args_parser().parse_args([
        f"--rdzv-backend={backend}", "--rdzv-endpoint=127.0.0.1:29400", "--nnodes=1:2",
        "--max-restarts=4", *command])
    with pytest.raises(Probed):
        run(args)
    assert seen == {"max_restarts": 4, "workers": workers}


def test_the_machine_hostname_check_still_recognises_this_machine() -> None:
    matches = _resolve(torch_compat.MATCHES_HOSTNAME)
    assert callable(matches) and re.search(r"\bhost\b", str(inspect.signature(matches)))
    assert torch_compat.matches_machine_hostname("127.0.0.1")
    assert torch_compat.matches_machine_hostname(socket.gethostname())
    assert not torch_compat.matches_machine_hostname("192.0.2.1")  # TEST-NET-1, never ours


def test_torchrun_still_stops_on_a_signal_by_raising_signal_exception() -> None:
    signal_exception = _resolve(torch_compat.SIGNAL_EXCEPTION)
    assert isinstance(signal_exception, type)
    assert "sigval" in inspect.signature(signal_exception).parameters, (
        f"{torch_compat.SIGNAL_EXCEPTION} no longer carries sigval")
    source = inspect.getsource(_resolve(torch_compat.LAUNCH_AGENT))
    assert re.search(r"except SignalException:[^\n]*\n(?:[^\n]*\n){0,8}?\s*raise\n", source), (
        f"{torch_compat.LAUNCH_AGENT} no longer lets SignalException out of torchrun: "
        "quiet_agent_exit() would never see it")


def test_launch_agent_keeps_the_run_result_in_result_until_its_finally() -> None:
    source = inspect.getsource(_resolve(torch_compat.LAUNCH_AGENT))
    assignment = source.find("result = agent.run()")
    finally_ = source.find("finally:")
    shutdown = source.find("rdzv_handler.shutdown()", finally_)
    assert -1 < assignment < finally_ < shutdown, (
        f"{torch_compat.LAUNCH_AGENT} no longer keeps agent.run()'s result in `result` before "
        "calling rdzv_handler.shutdown() in its finally: workers_succeeded() cannot see it")


class _Result:
    def __init__(self, failed: bool) -> None:
        self.failed = failed

    def is_failed(self) -> bool:
        return self.failed


def _shutdown_inside_a_launch_agent(result: object) -> bool:
    """``workers_succeeded()`` called as torch's ``launch_agent`` calls the shutdown."""
    seen: list[bool] = []
    namespace: dict[str, Any] = {"__name__": torch_compat.LAUNCH_AGENT.rsplit(".", 1)[0]}
    exec("def launch_agent(result, probe):\n"
         "    try:\n        return None\n    finally:\n        probe()\n", namespace)
    namespace["launch_agent"](result, lambda: seen.append(torch_compat.workers_succeeded()))
    return seen[0]


def test_workers_succeeded_reads_the_result_of_launch_agent_and_nothing_else() -> None:
    assert not torch_compat.workers_succeeded()  # no launch_agent frame: not under torchrun
    assert _shutdown_inside_a_launch_agent(_Result(failed=False))
    assert not _shutdown_inside_a_launch_agent(_Result(failed=True))
    assert not _shutdown_inside_a_launch_agent(None)  # agent.run() raised before returning


def test_a_leaving_agents_check_in_completes_torchs_exit_barrier_for_the_others() -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import barrier

    key = _resolve(torch_compat.EXIT_BARRIER_KEY)
    _resolve(torch_compat.BARRIER_CHECK_IN)
    agent = _resolve("torch.distributed.elastic.agent.server.api.SimpleElasticAgent")
    assert "key_prefix=_TERMINAL_STATE_SYNC_ID" in inspect.getsource(agent._exit_barrier), (
        "torch's agent no longer keeps its exit barrier under "
        f"{torch_compat.EXIT_BARRIER_KEY}: check_in_at_exit_barrier() counts in elsewhere")
    store = dist.HashStore()
    torch_compat.check_in_at_exit_barrier(store, world_size=2)  # the agent that left
    barrier(store, world_size=2, key_prefix=key, barrier_timeout=5)  # the other: no wait


def test_the_communicator_error_is_read_where_torch_keeps_it() -> None:
    """The CPU build has no ProcessGroupNCCL: check the method torch declares on every
    backend, the error names it returns, and that a gloo group (which raises in the
    calling thread instead) reads as healthy."""
    import torch
    import torch.distributed as dist

    stubs = (Path(torch.__file__).parent / "_C" / "_distributed_c10d.pyi").read_text()
    backend_stub = stubs[stubs.index("class Backend:"):]
    backend_stub = backend_stub[:backend_stub.index("\nclass ")]
    assert "def get_error(self) -> ErrorType" in backend_stub, (
        f"torch no longer declares {torch_compat.BACKEND_ERROR}: communicator_error() "
        "cannot tell a failed NCCL communicator")
    names = set(_resolve("torch._C._distributed_c10d.ErrorType").__members__)
    assert {"SUCCESS", "TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"} <= names
    assert torch_compat.communicator_error() is None  # no process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torch_compat.communicator_error() is None
    finally:
        dist.destroy_process_group()


def test_ddp_still_times_its_own_compute_apart_from_the_wait_for_peers() -> None:
    """The straggler judge's own time (``protocol/pace.py``): DDP's runtime stats, sampled
    at every step once asked, name the iteration and its forward and backward compute."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    for dotted in (torch_compat.DDP_RUNTIME_STATS, torch_compat.DDP_SAMPLE_RATE):
        assert callable(getattr(_resolve(dotted.rpartition(".")[0]), dotted.rpartition(".")[2],
                                None)), f"torch internal {dotted} is gone"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ddp = DistributedDataParallel(torch.nn.Linear(64, 64))
    try:
        torch_compat.time_every_ddp_step(ddp)
        seen = []
        for _ in range(14):  # past DDP's first ten, which it times whatever the rate
            ddp(torch.randn(8, 64)).sum().backward()
            ddp(torch.randn(8, 64))  # stats of a step are recorded as the next one starts
            timed = torch_compat.ddp_own_seconds(ddp)
            assert timed is not None, (
                f"DDP no longer reports forward/backward compute times through "
                f"{torch_compat.DDP_RUNTIME_STATS}: stragglers cannot be told")
            seen.append(timed[0])
        assert seen[-1] > 10 and len(set(seen[-4:])) == 4, seen  # every step timed
        assert timed is not None and 0 < timed[1] < 5
    finally:
        # DDP's reducer goes before its group: freed after the group was destroyed, its
        # gloo group's destructor once waited forever for its threads (a hung suite)
        del ddp
        dist.destroy_process_group()
