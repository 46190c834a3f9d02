"""The agent's side: start this node's warm-start server, export it, stop it.

Started when the etcd-ext handler is built (in torchrun's agent process), only when
the workers' command can use it: ``-m elastic_ext.warm ...`` or the bundled
``-m trainer``. It imports in the background while the first round forms.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from elastic_ext.torch_compat import WorkerCommand
from elastic_ext.warm import OFF, SOCKET_ENV, safety
from elastic_ext.warm.status import query_status
from elastic_ext.warm.target import Target, UsageError, parse_command

logger = logging.getLogger(__name__)

LAUNCHER_MODULE = "elastic_ext.warm"
SELF_LAUNCHING = frozenset({"trainer"})
"""Modules whose own entry hands off to the server (``launcher.hand_off``)."""
_CLOSE_WAIT_S = 5.0
_READY_POLL_S = 1.0
"""How often ``wait_ready`` looks whether the server is still alive."""


def warm_target(command: WorkerCommand | None) -> Target | None:
    """What the server should preload for torchrun's worker command; None: nothing can
    use a server (a script or module run without the launcher)."""
    if command is None or not command.module:
        return None
    if command.script == LAUNCHER_MODULE:
        try:
            target, _ = parse_command(command.args)
        except UsageError:
            return None  # the launcher will say what is wrong, in every worker
        return target
    if command.script in SELF_LAUNCHING:
        return Target.module(command.script)
    return None


class WarmStartServer:
    """One per agent: a child process serving ``SOCKET_ENV`` to this agent's workers."""

    def __init__(self, target: Target, preload: tuple[str, ...] = ()) -> None:
        self.target = target
        self._dir = tempfile.mkdtemp(prefix="elastic-ext-warm-",
                                     dir="/tmp" if os.path.isdir("/tmp") else None)
        self.socket_path = os.path.join(self._dir, "sock")
        # Bound here, so the socket exists before any worker starts; workers that come
        # before the server has finished importing wait in the listen backlog.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        listener.listen(128)
        command = [sys.executable, "-u", "-m", "elastic_ext.warm.server",
                   "--listen-fd", str(listener.fileno()), "--socket", self.socket_path,
                   "--agent-pid", str(os.getpid()), "--preload", ",".join(preload)]
        command += (["--module", target.name] if target.kind == "module"
                    else ["--path", os.path.abspath(target.name)])
        try:
            # the server asks NVML, not the driver, whether there is a GPU (safety.py)
            env = {safety.NVML_CUDA_CHECK_ENV: "1", **os.environ}
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=env,
                                          pass_fds=(listener.fileno(),))
        finally:
            listener.close()
        os.environ[SOCKET_ENV] = self.socket_path
        logger.info("etcd-ext: warm-start server %d for %s", self._proc.pid, target)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    def for_workers(cls, command: WorkerCommand | None, *, enabled: bool,
                    preload: tuple[str, ...] = ()) -> WarmStartServer | None:
        """The server the workers of ``command`` can use, or None (and the launcher told
        to start cold without a warning when warm start is turned off)."""
        if not enabled:
            os.environ[SOCKET_ENV] = OFF
            return None
        target = warm_target(command)
        return None if target is None else cls(target, preload)

    def wait_ready(self, timeout: float) -> bool:
        """Block until the server has done its imports (it answers a status query only
        then), at most ``timeout`` seconds; False if it did not answer, at once if it exited
        (an import that killed it: the workers start cold, each with a warning)."""
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                logger.warning("etcd-ext: warm-start server %d exited (status %s) before it was "
                               "ready; workers start cold", self._proc.pid, code)
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if query_status(self.socket_path, min(remaining, _READY_POLL_S)) is not None:
                return True

    def close(self) -> None:
        """Stop the server (it exits on EOF of its stdin) and remove its socket."""
        if os.environ.get(SOCKET_ENV) == self.socket_path:
            del os.environ[SOCKET_ENV]
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
