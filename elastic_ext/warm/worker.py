"""Running the user's module or script as ``python`` would, in a warm child or cold.

The one thing added: a script that knows nothing of elastic-ext and dies of a
peer's failure reports it to the etcd-ext agent and waits to be stopped, exactly as
the bundled trainer's guard does (:mod:`elastic_ext.worker.hold`), so torch's agent sees a
membership change instead of this worker's failure and spends no restart on it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
import traceback
from typing import NoReturn

from elastic_ext.warm.target import Target
from elastic_ext.worker.hold import exit_now, flush_std_streams, hold_after_peer_fault

_warm = False
_launched_at: float | None = None


def enter_warm_worker(launched_at: float) -> None:
    """Called once in a forked worker: this process is the worker, not a launcher."""
    global _warm, _launched_at
    _warm, _launched_at = True, launched_at


def in_warm_worker() -> bool:
    """True in a worker forked by the warm-start server."""
    return _warm


def launched_at() -> float:
    """Unix time this worker was launched: its launcher's start when warm, else its own."""
    if _launched_at is not None:
        return _launched_at
    return process_start_time(os.getpid())


def process_start_time(pid: int) -> float:
    """Unix time ``pid`` started, to about 10 ms (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22, starttime, counted after "pid (comm)"
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def exit_code_of(exc: SystemExit) -> int:
    """The status ``python`` would exit with after an uncaught ``SystemExit``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        if not -(1 << 63) <= code < 1 << 63:  # the interpreter's C long overflows: -1
            return 0xFF
        return code & 0xFF
    _write_stderr(f"{code}\n")  # what the interpreter itself writes
    return 1


def run_target(target: Target, args: list[str]) -> int:
    """Run ``target`` as ``__main__`` with ``args``; the exit status ``python`` would give.

    An uncaught ``KeyboardInterrupt`` ends the process by SIGINT, as ``python`` does
    (after the ``atexit`` handlers, as the interpreter runs them before it kills itself).
    """
    try:
        if target.kind == "module":
            _forget_imported(target.name)
            sys.argv = [target.name, *args]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target.name, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target.name))
            runpy.run_path(target.name, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exit_code_of(exc)
    except (ImportError, OSError) as exc:
        if not _raised_by_runpy(exc):  # the target's own
            return _uncaught(exc)
        # What ``python`` says and exits with when it cannot find what to run.
        if isinstance(exc, OSError) and target.kind == "path":
            _write_stderr(f"{sys.executable}: can't open file {os.path.abspath(target.name)!r}: "
                          f"[Errno {exc.errno}] {exc.strerror}\n")
            return 2
        _write_stderr(f"{sys.executable}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _die_of_sigint()
    except BaseException as exc:
        return _uncaught(exc)


def _uncaught(exc: BaseException) -> int:
    """Report an exception that left the target as the interpreter would: exit status 1.

    A peer's fault is held for the agent; by the script's ``PreemptionGuard`` (an
    ``ElasticLoop``'s) when it installed one, which keeps the step first. Either way the
    held worker leaves at once when its agent's signal comes (``exit_now``): the
    interpreter's teardown of the broken process group would take over a second.
    """
    preemption = sys.modules.get("elastic_ext.worker.preemption")  # imported by the script, or none
    guard = preemption.installed_guard() if preemption is not None else None
    if preemption is not None and guard is not None:
        try:
            code = guard.failure_exit_code(exc)
        except BaseException:  # noqa: BLE001 - not a peer's fault: reported below
            pass
        else:  # at once, as the guard's own loops leave: no teardown of a broken group
            preemption.exit_now(code)
    else:
        held = hold_after_peer_fault(exc)
        if held is not None:
            exit_now(held)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    return 1


def _raised_by_runpy(exc: BaseException) -> bool:
    """Whether ``runpy`` itself raised ``exc`` (no such module or file), not the target."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.basename(tb.tb_frame.f_code.co_filename) in ("runpy.py", "<frozen runpy>")


def _forget_imported(name: str) -> None:
    """Drop a module the warm-start server imported (its preload) that ``python -m name``
    would run fresh: ``runpy`` warns about, and the target would ``import`` the stale copy
    of, a module that is in ``sys.modules`` before it runs as ``__main__``."""
    module = sys.modules.get(name)
    if module is None or hasattr(module, "__path__"):  # a package: -m runs its __main__
        return
    del sys.modules[name]
    parent, _, child = name.rpartition(".")
    package = sys.modules.get(parent) if parent else None
    if package is not None and getattr(package, child, None) is module:
        delattr(package, child)


def _die_of_sigint() -> NoReturn:
    import atexit

    atexit._run_exitfuncs()
    flush_std_streams()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.raise_signal(signal.SIGINT)  # delivered to this thread before it returns
    os._exit(128 + signal.SIGINT)


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
    except (AttributeError, OSError, ValueError):  # no stderr, or a closed one
        pass

