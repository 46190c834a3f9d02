"""Every place etcd-ext relies on a torch internal, behind one function each.

torch's public elastic API does not tell a rendezvous handler everything it needs
(the agent's ``--max-restarts``, whether the agent is shutting down because its
workers failed for good, which host names are this machine). What etcd-ext reads
from torch's internals instead lives here and nowhere else, and
``tests/test_torch_compat.py`` checks each one against the installed torch, so a
torch upgrade that removes or changes one fails loudly, naming it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

LAUNCH_AGENT = "torch.distributed.launcher.api.launch_agent"
ARGS_PARSER = "torch.distributed.run.get_args_parser"
MATCHES_HOSTNAME = "torch.distributed.elastic.rendezvous.utils._matches_machine_hostname"
SIGNAL_EXCEPTION = "torch.distributed.elastic.multiprocessing.api.SignalException"
EXIT_BARRIER_KEY = "torch.distributed.elastic.agent.server.api._TERMINAL_STATE_SYNC_ID"
BARRIER_CHECK_IN = "torch.distributed.elastic.utils.store._barrier_nonblocking"
BACKEND_ERROR = "torch._C._distributed_c10d.Backend.get_error"
DDP_RUNTIME_STATS = "torch.nn.parallel.DistributedDataParallel._get_ddp_logging_data"
DDP_SAMPLE_RATE = "torch.nn.parallel.DistributedDataParallel._set_ddp_runtime_logging_sample_rate"

STOPPED_LINE = ("torchrun stopped by {signal}: its workers got it too (the bundled trainer, and "
                "loops using elastic_ext.worker.preemption, save a snapshot and exit 0); torchrun "
                "itself exits 1 after a signal, which a plugin cannot change")
_quiet_exit_installed = False
_after_signal: Callable[[int], str | None] | None = None


def on_agent_signal(callback: Callable[[int], str | None]) -> None:
    """What to do when a signal stops torchrun's agent (``quiet_agent_exit``), after torch
    stopped the workers and skipped the rendezvous shutdown: ``callback(signum)`` returns
    the line to exit 0 with when this node's part ended well (it left and the others train
    on), None to exit 1 as torch does."""
    global _after_signal
    _after_signal = callback


def _launch_agent_locals() -> dict[str, Any] | None:
    """The locals of ``LAUNCH_AGENT`` on this thread's stack, when the handler is being
    built inside it: ``config`` (torch's ``LaunchConfig``), ``entrypoint`` and ``args``
    (the workers' command). torch's agent is started that way whatever started it
    (``torchrun``, ``python -m torch.distributed.run``, ``accelerate launch``, a direct
    ``elastic_launch``), while ``sys.argv`` is the launcher's own command line."""
    module = LAUNCH_AGENT.rsplit(".", 1)[0]
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "launch_agent" and frame.f_globals.get("__name__") == module:
            return dict(frame.f_locals)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _torchrun_args(argv: Sequence[str] | None) -> argparse.Namespace | None:
    """torchrun's own parse (``get_args_parser``, ``PET_*`` included) of its command line."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program != "torchrun" and not argv[0].endswith(os.path.join("distributed", "run.py")):
        return None
    from torch.distributed.run import get_args_parser

    try:
        return get_args_parser().parse_args(argv[1:])
    except SystemExit:
        return None


def torchrun_max_restarts(argv: Sequence[str] | None = None) -> int | None:
    """``--max-restarts`` of the elastic agent this handler is built for, if any.

    The handler is not told the agent's restart budget, yet it keeps the job-wide
    count: it is read from ``LAUNCH_AGENT``'s ``config`` (any launcher), else from
    torchrun's command line (``argv``, default ``sys.argv``) with torchrun's own parser.
    None when neither is there.
    """
    found = _launch_agent_locals() if argv is None else None
    config = found.get("config") if found else None
    if config is not None and hasattr(config, "max_restarts"):
        return int(config.max_restarts)
    args = _torchrun_args(argv)
    return None if args is None else int(args.max_restarts)


@dataclass(frozen=True)
class WorkerCommand:
    """What torchrun runs as each worker: ``python -u [-m] SCRIPT ARGS``."""

    module: bool
    script: str
    args: tuple[str, ...]


def _python_worker(entrypoint: object, args: Sequence[object]) -> WorkerCommand | None:
    """``LAUNCH_AGENT``'s ``entrypoint`` and ``args`` as torch's ``config_from_args`` builds
    them for Python workers (``sys.executable``, then ``-u``, ``-m`` when a module, the
    script and its arguments); None for any other program or a function."""
    if not isinstance(entrypoint, str) or os.path.realpath(entrypoint) != \
            os.path.realpath(sys.executable):
        return None
    rest = [str(a) for a in args]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    module = rest[:1] == ["-m"]
    if module:
        rest = rest[1:]
    if not rest:
        return None
    return WorkerCommand(module=module, script=rest[0], args=tuple(rest[1:]))


def torchrun_worker_command(argv: Sequence[str] | None = None) -> WorkerCommand | None:
    """The workers' command of the elastic agent this handler is built for (read as
    ``torchrun_max_restarts`` reads the budget); None when there is none or its workers
    are not Python (``--no-python``)."""
    found = _launch_agent_locals() if argv is None else None
    if found is not None and "entrypoint" in found:
        return _python_worker(found.get("entrypoint"), found.get("args") or ())
    args = _torchrun_args(argv)
    if args is None or args.no_python:
        return None
    return WorkerCommand(module=bool(args.module), script=str(args.training_script),
                         args=tuple(str(a) for a in args.training_script_args))


def agent_gave_up() -> bool:
    """Whether torch's agent is shutting the handler down because its workers failed for good.

    ``LAUNCH_AGENT`` raises ``ChildFailedError`` once the workers exhausted
    ``--max-restarts`` and calls ``rdzv_handler.shutdown()`` in its ``finally``, so
    inside ``shutdown`` that error is the exception being handled.
    """
    return isinstance(sys.exc_info()[1], ChildFailedError)


def workers_succeeded() -> bool:
    """Whether torch's agent is shutting the handler down after its workers succeeded.

    ``LAUNCH_AGENT`` keeps the agent's ``RunResult`` in its local ``result`` and calls
    ``rdzv_handler.shutdown()`` in its ``finally``; the result is read from that frame.
    False when there is no such frame (not under torchrun) or the workers failed.
    """
    found = _launch_agent_locals()
    is_failed = getattr(found.get("result") if found else None, "is_failed", None)
    return callable(is_failed) and not is_failed()


def check_in_at_exit_barrier(store: Any, world_size: int) -> None:
    """Count this agent in at torch's exit barrier of the round whose workers' ``store``
    this is, as an agent whose workers finished does. An agent that leaves a round for
    good (stopped by a signal) does, so that the others, whose workers finish, do not wait
    ``exit_barrier_timeout`` (300 s) for it: torch's agent keeps the barrier in
    ``EXIT_BARRIER_KEY`` and counts in with ``BARRIER_CHECK_IN``."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    _barrier_nonblocking(store=store, world_size=world_size, key_prefix=_TERMINAL_STATE_SYNC_ID)


def communicator_error(group: Any = None) -> str | None:
    """Why the default group's NCCL communicator failed (``TIMEOUT``, ``COMM_ERROR``,
    ``REMOTE_ERROR``: torch's ``ErrorType``), None while it is healthy or it is not NCCL.

    ``ProcessGroupNCCL::getError`` (``BACKEND_ERROR``, bound only in CUDA builds) records
    the first failure the watchdog saw, before the training thread raises it, so a step
    the device finished after that is known not to have been reduced properly. gloo fails
    in the calling thread instead and does not support it: None.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.get_backend(pg) != "nccl":
        return None
    get_error = getattr(pg._get_backend(torch.device("cuda")), "get_error", None)
    if get_error is None:  # a torch without it: the training thread's exception tells
        return None
    error = get_error()
    return None if error.name == "SUCCESS" else str(error.name)


def time_every_ddp_step(ddp: Any) -> None:
    """Have DDP's reducer time its forward and backward compute at every step
    (``DDP_SAMPLE_RATE``; by default the first ten, then one in a hundred). On a GPU it times
    them with CUDA events, read when the next step starts, after the step's device work
    finished anyway; on the CPU with the wall clock."""
    ddp._set_ddp_runtime_logging_sample_rate(1)


def ddp_own_seconds(ddp: Any) -> tuple[int, float] | None:
    """(the iteration DDP last timed, its forward + backward compute in seconds), without
    the time the backward waited for the other ranks' gradients; None before DDP timed one
    (``DDP_RUNTIME_STATS``, a prototype interface of DDP's)."""
    stats = ddp._get_ddp_logging_data()
    forward, backward = stats.get("forward_compute_time"), stats.get("backward_compute_time")
    if not isinstance(forward, int) or not isinstance(backward, int) or forward + backward <= 0:
        return None
    return int(stats.get("iteration", 0)), (forward + backward) / 1e9


def matches_machine_hostname(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its host name, or one of its addresses)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def quiet_agent_exit() -> None:
    """Print one line instead of a traceback when torchrun's agent ends for a reason the
    message says in full: stopped by a signal, a ``--rdzv-conf`` or store error while
    torchrun builds the handler, this node's part of the job over.

    torch's agent turns SIGINT and SIGTERM into ``SIGNAL_EXCEPTION``, which
    ``LAUNCH_AGENT`` re-raises out of torchrun's ``main``, as it does any error of the
    handler's construction; Python then prints a stack trace and exits 1. The handler
    lives in the agent's process, so it can install an ``excepthook`` that says what
    happened in one line; every other exception keeps the hook it had. The exit status
    stays torch's 1, but for a node whose part ended well (0).
    """
    global _quiet_exit_installed
    if _quiet_exit_installed:
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elastic_ext.rendezvous.errors import (
        ConfigError,
        JobFinishedError,
        NodeExcludedError,
        NodeLeftError,
        StoreAuthError,
        StoreUnavailableError,
    )

    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if isinstance(exc, (JobFinishedError, NodeLeftError, NodeExcludedError)):
            # The message says it all; a finished job, or leaving it on a notice while the
            # others train on, is no failure of this node (exit 0), a node the others cannot
            # reach is (exit 1).
            _exit_with_line(str(exc), 1 if isinstance(exc, NodeExcludedError) else 0)
        if isinstance(exc, (ConfigError, StoreAuthError, StoreUnavailableError)):
            _exit_with_line(f"torchrun --rdzv-backend=etcd-ext: {exc}", 1)
        if isinstance(exc, SignalException):
            try:
                left = _after_signal(exc.sigval) if _after_signal is not None else None
            except Exception as error:  # the store may be gone too: exit as torch does
                sys.stderr.write(f"etcd-ext: could not leave the run: {error}\n")
                left = None
            if left:
                _exit_with_line(left, 0)
            _exit_with_line(STOPPED_LINE.format(signal=signal.Signals(exc.sigval).name), 1)
        previous(kind, exc, tb)

    sys.excepthook = hook
    _quiet_exit_installed = True


def _exit_with_line(line: str, code: int) -> NoReturn:
    """Write ``line`` and leave without interpreter teardown, after the exit handlers
    (logging's, the agent's clean-up): torch's agent skips the rendezvous shutdown after a
    signal, and destroying its live C++ stores at teardown can abort the process
    ("terminate called without an active exception") instead of exiting."""
    sys.stderr.write(line + "\n")
    atexit._run_exitfuncs()
    sys.stderr.flush()
    os._exit(code)
