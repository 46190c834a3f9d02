"""The per-node fork server: ``python -m elastic_ext.warm.server`` (started by the agent).

It imports the training module's imports once, then forks one worker per launcher
request. It never runs user code itself, never touches a device and starts no
thread, so every fork is as good as a fresh interpreter (``safety`` checks before
each fork and refuses otherwise). It keeps no worker alive longer than the worker's
launcher or its own agent: a launcher's EOF gets its worker SIGKILLed, the agent's
death (a ``pidfd``) all of them, and a worker dies with the server
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import select
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from elastic_ext.warm import RELAYED_SIGNALS, preload, safety
from elastic_ext.warm.protocol import ProtocolError, RunRequest, recv_message, send_message
from elastic_ext.warm.target import Target
from elastic_ext.warm.worker import enter_warm_worker, run_target
from elastic_ext.worker.control import report_notice

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_REQUEST_READ_TIMEOUT_S = 5.0


@dataclass
class Forked:
    """What a forked child takes into its new life as a worker."""

    request: RunRequest
    fds: list[int]
    server_pid: int


class Server:
    def __init__(self, listener: socket.socket, socket_path: str, agent_pid: int,
                 allowed_threads: int) -> None:
        self.socket_path = socket_path
        self.allowed_threads = allowed_threads
        self._selector = selectors.DefaultSelector()
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._agent = os.pidfd_open(agent_pid)
        self._workers: dict[socket.socket, int] = {}
        """A live worker's launcher connection, by worker pid (removed when reaped)."""
        self._orphans: set[int] = set()
        """Workers whose launcher went away: killed, still to be reaped."""

    def _register(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self._agent, selectors.EVENT_READ)
        if not os.isatty(0):
            self._selector.register(0, selectors.EVENT_READ)  # the agent's pipe: EOF = close

    def serve(self) -> Forked:
        """Serve until the agent closes or dies (then exit); returns only in a forked worker."""
        self._register()
        while True:
            for key, _ in self._selector.select():
                fileobj = key.fileobj
                if fileobj is self._listener:
                    self._accept()
                elif fileobj is self._wake_r:
                    self._wake_r.recv(4096)
                    self._reap()
                elif fileobj is self._agent or fileobj == 0:
                    self._exit("the agent is gone" if fileobj is self._agent else
                               "the agent closed the server")
                else:
                    assert isinstance(fileobj, socket.socket)
                    forked = self._on_readable(fileobj)
                    if forked is not None:
                        return forked

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            logger.warning("refused a connection from uid %d: only this agent's user may "
                           "start workers", uid)
            conn.close()
            return
        self._selector.register(conn, selectors.EVENT_READ)

    def _on_readable(self, conn: socket.socket) -> Forked | None:
        if conn in self._workers:  # a launcher sends nothing after its request: it is gone
            pid = self._workers.pop(conn)
            self._forget(conn)
            logger.info("the launcher of worker %d went away: killing it", pid)
            _kill_group(pid)
            self._orphans.add(pid)
            return None
        conn.settimeout(_REQUEST_READ_TIMEOUT_S)
        try:
            message, fds = recv_message(conn, max_fds=3)
        except (ProtocolError, OSError) as exc:
            logger.warning("dropped a bad request: %s", exc)
            self._forget(conn)
            return None
        conn.settimeout(None)
        if message is None:
            self._forget(conn)
            return None
        if message.get("op") == "status":
            self._reply(conn, self.check().to_message())
            self._forget(conn)
            return None
        try:
            if message.get("op") != "run" or len(fds) != 3:
                raise ProtocolError("expected a run request with stdin, stdout and stderr")
            request = RunRequest.from_message(message)
        except ProtocolError as exc:
            _close_all(fds)
            self._reply(conn, {"refused": str(exc)})
            self._forget(conn)
            return None
        hazards = self.check().hazards
        if hazards:
            _close_all(fds)
            self._reply(conn, {"refused": "not safe to fork: " + "; ".join(hazards)})
            self._forget(conn)
            return None
        return self._fork(conn, request, fds)

    def check(self) -> safety.ForkSafety:
        """This process's fork hazards now."""
        return safety.check(self.allowed_threads, preload.thread_starters(),
                            preload.cuda_driver_importer())

    def agent_alive(self) -> bool:
        """False once the agent is gone (its pidfd is readable): then nothing is worth doing."""
        ready, _, _ = select.select([self._agent], [], [], 0)
        return not ready

    def _fork(self, conn: socket.socket, request: RunRequest, fds: list[int]) -> Forked | None:
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._close_in_child()
            return Forked(request, fds, server_pid)
        _close_all(fds)
        self._workers[conn] = pid
        logger.debug("forked worker %d (%s)", pid, Target(request.kind, request.name))
        if not self._reply(conn, {"pid": pid}):
            self._workers.pop(conn, None)
            self._forget(conn)
            _kill_group(pid)
            self._orphans.add(pid)
        return None

    def _reply(self, conn: socket.socket, message: dict[str, object]) -> bool:
        try:
            send_message(conn, message)
            return True
        except OSError:
            return False

    def _forget(self, conn: socket.socket) -> None:
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._orphans.discard(pid)
            for conn, worker in list(self._workers.items()):
                if worker == pid:
                    del self._workers[conn]
                    self._reply(conn, {"status": status})
                    self._forget(conn)

    def _close_in_child(self) -> None:
        """Drop every descriptor of the server's (through its object, so no stale close
        later hits a descriptor the worker reused)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for conn in [k.fileobj for k in self._selector.get_map().values()]:
            if isinstance(conn, socket.socket):
                conn.close()
        self._selector.close()
        self._wake_w.close()
        os.close(self._agent)

    def _exit(self, why: str) -> NoReturn:
        for pid in [*self._workers.values(), *self._orphans]:
            _kill_group(pid)
        try:
            os.unlink(self.socket_path)
            os.rmdir(os.path.dirname(self.socket_path))  # the agent's private directory
        except OSError:  # its close() may be removing both right now
            pass
        logger.debug("warm-start server exits: %s", why)
        logging.shutdown()
        os._exit(0)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def become_worker(forked: Forked) -> int:
    """In the forked child: turn into the process torchrun would have started, run it."""
    os.setsid()  # torchrun starts each worker in a session (and process group) of its own
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != forked.server_pid:  # the server died before prctl took hold
        os._exit(128 + signal.SIGKILL)
    for target_fd, fd in enumerate(forked.fds):
        os.dup2(fd, target_fd)
    _close_all(forked.fds)
    request = forked.request
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    os.umask(request.umask)
    _apply_rlimits(request.rlimits)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    set_worker_signals()
    _reseed_numpy()
    enter_warm_worker(request.launched_at)
    return run_target(Target(request.kind, request.name), request.argv)


def set_worker_signals() -> None:
    """The dispositions a fresh ``python`` starts with, but for SIGUSR2 (SLURM's advance
    notice): until the script installs its own handler, a notice is passed to the agent
    (``control.report_notice``) instead of killing the worker. A fresh interpreter has the
    same window between exec and the script's handler; here it is closed. Then the signals
    the server blocked are unblocked."""
    for signum in RELAYED_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                      else signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, _record_notice)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED_SIGNALS)


def _record_notice(signum: int, frame: FrameType | None) -> None:
    report_notice(f"{signal.Signals(signum).name} to a worker before its handler")


def _reseed_numpy() -> None:
    """numpy seeds its global generator from the OS at import, in the server: every
    worker would draw the same numbers. A fresh interpreter would not (``random`` is
    reseeded by CPython itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _apply_rlimits(rlimits: dict[str, list[int]]) -> None:
    import resource

    for name, (soft, hard) in rlimits.items():
        which = getattr(resource, name, None)
        if which is None or resource.getrlimit(which) == (soft, hard):
            continue
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not give the worker its %s=%s: %s", name, (soft, hard), exc)


def use_nvml_cuda_check() -> None:
    """Have ``torch.cuda.is_available()`` in the server ask NVML instead of the CUDA driver.

    torch/cuda/__init__.py: ``is_available()`` calls ``device_count()``, which without
    ``_nvml_based_avail()`` (``PYTORCH_NVML_BASED_CUDA_CHECK == "1"``, read at each call)
    asks the CUDA runtime: that loads ``libcuda`` and runs ``cuInit`` but leaves
    ``torch.cuda.is_initialized()`` False, and every forked worker's first CUDA call fails.
    Training scripts call it at import time (``DEVICE = "cuda" if ... else "cpu"``). Set
    before anything imports torch here (this module's imports do not); a value the agent
    was given is kept. Workers do not inherit it: they get their launcher's environment.
    Where NVML fails torch falls back to the runtime, which ``safety`` then reports."""
    os.environ.setdefault(safety.NVML_CUDA_CHECK_ENV, "1")


def main(argv: Sequence[str] | None = None) -> int:
    use_nvml_cuda_check()
    parser = argparse.ArgumentParser(prog="python -m elastic_ext.warm.server",
                                     description="etcd-ext's per-node fork server (started by "
                                                 "the agent; not for direct use)")
    parser.add_argument("--listen-fd", type=int, required=True,
                        help="the agent's listening Unix socket, inherited")
    parser.add_argument("--socket", required=True, help="its path, removed on exit")
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument("--module", help="the target module, as after python -m")
    parser.add_argument("--path", help="the target script")
    parser.add_argument("--preload", default="", help="extra modules to import, comma-separated")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s etcd-ext warm-start server %(levelname)s: %(message)s")
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED_SIGNALS)
    began = time.monotonic()
    try:
        listener = socket.socket(fileno=args.listen_fd)
        server = Server(listener, args.socket, args.agent_pid,
                        allowed_threads=safety.baseline_threads())
    except ProcessLookupError:
        return 0  # the agent is already gone
    target = Target("module", args.module) if args.module else Target("path", args.path)
    loaded = preload.preload(target, [m for m in args.preload.split(",") if m],
                             keep_going=server.agent_alive)
    hazards = server.check().hazards
    if hazards:
        logger.warning("%s is not safe to fork after its imports (%s): workers will start "
                       "cold; see docs/warm-start.md", target, "; ".join(hazards))
    else:
        logger.info("ready in %.1fs for %s (%d modules preloaded)",
                    time.monotonic() - began, target, len(loaded))
    forked = server.serve()
    return become_worker(forked)


if __name__ == "__main__":
    sys.exit(main())
