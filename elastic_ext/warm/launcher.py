"""The launcher: ``python -m elastic_ext.warm (-m MODULE | SCRIPT) [ARGS...]``.

torchrun starts it as the worker. It asks the node's warm-start server to fork the
real worker with this process's argv, environment, working directory, umask,
resource limits and standard streams, relays the signals torchrun sends, and exits
with the worker's status (by the same signal if the worker died of one). Without a
server it runs the target itself, cold. It imports nothing heavy.
"""

from __future__ import annotations

import logging
import os
import resource
import selectors
import signal
import socket
import sys
from typing import NoReturn

from elastic_ext.warm import OFF, RELAYED_SIGNALS, SOCKET_ENV
from elastic_ext.warm.protocol import ProtocolError, RunRequest, recv_message, send_message
from elastic_ext.warm.target import Target, UsageError, parse_command
from elastic_ext.warm.worker import in_warm_worker, process_start_time, run_target
from elastic_ext.worker.hold import flush_std_streams, hold_for_agent

logger = logging.getLogger(__name__)


def _rlimits() -> dict[str, list[int]]:
    names = [name for name in dir(resource) if name.startswith("RLIMIT_")]
    return {name: list(resource.getrlimit(getattr(resource, name))) for name in names}


def request_for(target: Target, args: list[str]) -> RunRequest:
    """This process, described for the server to recreate in a fork."""
    umask = os.umask(0)
    os.umask(umask)
    return RunRequest(kind=target.kind, name=target.name, argv=list(args), env=dict(os.environ),
                      cwd=os.getcwd(), umask=umask, rlimits=_rlimits(),
                      launched_at=process_start_time(os.getpid()))


_went_cold = False
"""Set once this process runs its target itself: a target that hands off in turn (the
bundled trainer, run as ``-m elastic_ext.warm -m trainer``) then runs cold as well,
instead of asking the server again and warning twice."""


def hand_off(target: Target, args: list[str]) -> None:
    """Have this node's warm-start server run ``target``; returns only when this process
    must run it itself: no server (cold), or this already is the forked worker."""
    global _went_cold
    if in_warm_worker() or _went_cold:
        return
    path = os.environ.get(SOCKET_ENV)
    if not path or path == OFF:
        return
    status = Launch(path).run(request_for(target, args))
    if status is not None:
        exit_with_status(status)
    _went_cold = True


class Launch:
    """One request to the server, from connect to the worker's exit status."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.worker: int | None = None
        self._pending: list[int] = []

    def run(self, request: RunRequest) -> int | None:
        """The worker's raw wait status, or None to start cold (after one warning)."""
        previous = {signum: signal.signal(signum, _ignore_here) for signum in RELAYED_SIGNALS}
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.connect(self.socket_path)
            except OSError as exc:
                self._cold(f"the warm-start server at {self.socket_path} is not there ({exc})")
                return None
            try:
                send_message(sock, request.to_message(), fds=_standard_fds())
            except (OSError, ProtocolError) as exc:
                self._cold(f"could not send the request to the warm-start server ({exc})")
                return None
            return self._wait(sock, wake_r)
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            if self.worker is None:  # cold: signals that came meanwhile are this process's
                self._pending.extend(_drain(wake_r))
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for s in (sock, wake_r, wake_w):
                s.close()
            if self.worker is None:
                for pending in dict.fromkeys(self._pending):
                    signal.raise_signal(pending)

    def _wait(self, sock: socket.socket, wake_r: socket.socket) -> int | None:
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        agent = _pidfd(os.getppid())
        if agent is not None:
            selector.register(agent, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fileobj is wake_r:
                        for signum in wake_r.recv(256):
                            self._relay(signum)
                    elif key.fileobj is agent:
                        # The agent died: leave; the server kills the worker on our EOF.
                        os._exit(128 + signal.SIGKILL)
                    else:
                        status = self._on_message(sock)
                        if status is not None:
                            return None if status < 0 else status
        finally:
            selector.close()
            if agent is not None:
                os.close(agent)

    def _on_message(self, sock: socket.socket) -> int | None:
        """A wait status when the launch is over (-1: go cold), else None."""
        try:
            message, _ = recv_message(sock)
        except (ProtocolError, OSError) as exc:
            message = None
            logger.debug("warm-start server connection failed: %s", exc)
        if message is None:
            if self.worker is None:
                self._cold("the warm-start server closed the connection before forking")
                return -1
            return self._server_lost()
        if "refused" in message:
            self._cold(f"the warm-start server refused: {message['refused']}")
            return -1
        try:
            if "pid" in message and self.worker is None:
                pid = int(message["pid"])
                if pid <= 1:
                    raise ValueError(f"no worker has pid {pid}")
                self.worker = pid
                for signum in self._pending:
                    self._relay(signum)
                self._pending.clear()
            elif "status" in message and self.worker is not None:
                return int(message["status"]) & 0xFFFF
            return None  # nothing this launcher knows of: a newer server's news
        except (TypeError, ValueError, OverflowError) as exc:
            logger.error("etcd-ext warm start: the server sent %s: %s", str(message)[:200], exc)
        if self.worker is None:
            self._cold("the warm-start server's reply was not one of its protocol")
            return -1
        return self._server_lost()

    def _relay(self, signum: int) -> None:
        if self.worker is None:
            self._pending.append(signum)
            return
        for kill in (os.killpg, os.kill):  # the worker leads its own group once it set it up
            try:
                kill(self.worker, signum)
                return
            except OSError:  # no such group (yet, or any more)
                continue

    def _server_lost(self) -> int:
        """The server died under a running worker, which died with it (PDEATHSIG)."""
        code = hold_for_agent("the warm-start server died, and this worker with it",
                              setup_fault=True)
        logger.error("etcd-ext warm start: the server died while worker %s ran; the next "
                     "workers start cold", self.worker)
        return (code if code is not None else 1) << 8

    def _cold(self, why: str) -> None:
        logger.warning("etcd-ext warm start: %s; this worker starts cold", why)


def _standard_fds() -> tuple[int, ...]:
    """Descriptors 0, 1 and 2 for the worker: ``/dev/null`` for a closed one (as good as
    closed to a Python worker, and a closed one would fail the whole request)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            fd = os.open(os.devnull, os.O_RDWR)  # open until this process ends
        fds.append(fd)
    return tuple(fds)


def _drain(wake_r: socket.socket) -> list[int]:
    """Signal numbers the wakeup descriptor holds, not yet relayed."""
    wake_r.setblocking(False)
    got: list[int] = []
    while True:
        try:
            chunk = wake_r.recv(256)
        except (BlockingIOError, InterruptedError):
            return got
        if not chunk:
            return got
        got.extend(chunk)


def _ignore_here(signum: int, frame: object) -> None:
    """The wakeup descriptor carries the signal to the loop, which relays it."""


def _pidfd(pid: int) -> int | None:
    if pid <= 1:
        return None
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


_NOT_FATAL = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH,
                        signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
"""Signals whose default action ignores or stops: raised here, they would not end this."""


def exit_with_status(status: int) -> NoReturn:
    """Leave as the worker left: its exit code, or death by its signal (without a second
    core dump: the worker wrote one if its limits asked for it)."""
    flush_std_streams()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_CORE)
            resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
        except (OSError, ValueError):
            pass
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # no handler to reset for those
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        if signum not in _NOT_FATAL:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            signal.raise_signal(signum)  # delivered to this thread before it returns
        os._exit(128 + signum)  # a signal that ends no process (a garbled status)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    os._exit(1)  # not a status of an ended process


def main(argv: list[str] | None = None) -> int:
    try:
        target, args = parse_command(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    hand_off(target, args)
    return run_target(target, args)
