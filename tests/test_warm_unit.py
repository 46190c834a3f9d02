"""Warm start's parts, in this process: the wire format, the command line, running a
target as ``python`` would, the launcher's exit and its talk with a server, settings."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.agent.control import AgentControl
from elastic_ext.control_channel import CONTROL_DIR_ENV
from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.settings import parse_settings
from elastic_ext.warm import OFF, SOCKET_ENV, launcher
from elastic_ext.warm.launcher import Launch, exit_with_status, hand_off, request_for
from elastic_ext.warm.protocol import (
    MAX_MESSAGE,
    ProtocolError,
    RunRequest,
    recv_message,
    send_message,
)
from elastic_ext.warm.server import set_worker_signals
from elastic_ext.warm.target import USAGE, Target, UsageError, parse_command
from elastic_ext.warm.worker import exit_code_of, run_target

pytestmark = pytest.mark.timeout(30)


def a_request(**changes: Any) -> RunRequest:
    fields: dict[str, Any] = dict(kind="path", name="/job/train.py", argv=["--lr", "0.1"],
                                  env={"RANK": "1", "EMPTY": "", "UNICODE": "é"}, cwd="/job",
                                  umask=0o022, rlimits={"RLIMIT_NOFILE": [1024, 4096]},
                                  launched_at=12.5)
    fields.update(changes)
    return RunRequest(**fields)


# --- the wire format ---------------------------------------------------------------


def test_a_request_and_three_descriptors_cross_a_socket_intact() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        request = a_request()
        send_message(a, request.to_message(), fds=(r, w, w))
        message, fds = recv_message(b, max_fds=3)
        assert message is not None and message["op"] == "run"
        assert RunRequest.from_message(message) == request
        assert len(fds) == 3 and not {r, w} & set(fds)  # new descriptors, same files
        os.write(fds[1], b"through the copy")
        assert os.read(r, 100) == b"through the copy"
        for fd in fds:
            os.close(fd)
        send_message(a, {"status": 3 << 8})
        assert recv_message(b) == ({"status": 768}, [])
    finally:
        for closable in (a, b):
            closable.close()
        os.close(r)
        os.close(w)


def test_a_clean_end_of_stream_is_no_message() -> None:
    a, b = socket.socketpair()
    a.close()
    try:
        assert recv_message(b, max_fds=3) == (None, [])
    finally:
        b.close()


def framed(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def descriptors_of(target: str) -> set[int]:
    """This process's descriptors that refer to ``target`` (as ``/proc/self/fd`` names it)."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry) == target:
                found.add(int(entry.name))
        except FileNotFoundError:  # closed meanwhile (the listing's own, for one)
            pass
    return found


@pytest.mark.parametrize("raw", [
    struct.pack("!I", MAX_MESSAGE + 1) + b"{}",
    framed(b"not json"),
    framed(b"[1, 2]"),
    framed(b"\xff\xfe{}"),
    framed(b"[" * 100_000),
    struct.pack("!I", 100) + b'{"op": "ru',  # and then the peer is gone
    b"\x00\x00",  # half a header
], ids=["oversized", "not-json", "not-an-object", "not-utf8", "nested-too-deep", "truncated",
        "short-header"])
def test_garbage_is_a_protocol_error_and_its_descriptors_are_closed(
        raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[int] = []
    real_recv_fds = socket.recv_fds

    def recording_recv_fds(*args: Any, **kwargs: Any) -> Any:
        result = real_recv_fds(*args, **kwargs)
        received.extend(result[1])
        return result

    # The received copies counted themselves, not the process's whole fd table: a thread
    # another test left running may open or close a descriptor meanwhile.
    monkeypatch.setattr(socket, "recv_fds", recording_recv_fds)
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(a, [raw[:1]], [r, w])
        a.sendall(raw[1:])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError):
            recv_message(b, max_fds=3)
        assert len(received) == 2
        # The received copies were closed: no descriptor but ours refers to the pipe (by
        # number alone a closed copy's may already be another thread's new file).
        assert descriptors_of(f"pipe:[{os.fstat(r).st_ino}]") == {r, w}
    finally:
        for closable in (a, b):
            closable.close()
        os.close(r)
        os.close(w)


def test_a_message_over_the_limit_is_not_sent() -> None:
    a, b = socket.socketpair()
    try:
        with pytest.raises(ProtocolError, match="limit"):
            send_message(a, {"env": {"BIG": "x" * MAX_MESSAGE}})
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("change", [
    {"kind": "exec"},
    {"name": ""},
    {"argv": "--lr 0.1"},
    {"env": [["A", "1"]]},
    {"env": {"A=B": "1"}},
    {"env": {"A": "nul\0byte"}},
    {"umask": "u=rwx"},
    {"umask": 0o7777},
    {"umask": 1e400},
    {"cwd": "relative/dir"},
    {"rlimits": {"RLIMIT_NOFILE": [1]}},
    {"rlimits": {"RLIMIT_NOFILE": "1024"}},
], ids=lambda c: "-".join(f"{k}={v!r}"[:20] for k, v in c.items()))
def test_a_malformed_run_request_is_a_protocol_error(change: dict[str, Any]) -> None:
    message = a_request().to_message()
    message.update(change)
    with pytest.raises(ProtocolError):
        RunRequest.from_message(message)


def test_a_run_request_without_a_field_is_a_protocol_error() -> None:
    message = a_request().to_message()
    del message["cwd"]
    with pytest.raises(ProtocolError, match="cwd"):
        RunRequest.from_message(message)


# --- the command line --------------------------------------------------------------


@pytest.mark.parametrize(("args", "target", "rest"), [
    (["-m", "trainer", "--steps", "5"], Target("module", "trainer"), ["--steps", "5"]),
    (["-mtrainer", "-m", "x"], Target("module", "trainer"), ["-m", "x"]),
    (["-m", "pkg.mod"], Target("module", "pkg.mod"), []),
    (["train.py", "-m", "--help"], Target("path", "train.py"), ["-m", "--help"]),
    (["/abs/train.py"], Target("path", "/abs/train.py"), []),
])
def test_the_command_line_names_a_module_or_a_script(
        args: list[str], target: Target, rest: list[str]) -> None:
    assert parse_command(args) == (target, rest)


@pytest.mark.parametrize(("args", "says"), [
    ([], "usage: python -m elastic_ext.warm"),
    (["--help"], "usage: python -m elastic_ext.warm"),
    (["-m"], "-m needs a module name"),
    (["-m", "--lr"], "-m needs a module name"),
    (["-u", "train.py"], "python options go to torchrun's interpreter"),
])
def test_a_bad_command_line_is_a_usage_error_that_shows_the_usage(
        args: list[str], says: str) -> None:
    with pytest.raises(UsageError) as raised:
        parse_command(args)
    assert says in str(raised.value) and USAGE in str(raised.value)


def test_str_of_a_target_reads_as_its_command_line() -> None:
    assert (str(Target.module("trainer")), str(Target("path", "a.py"))) == ("-m trainer", "a.py")


@pytest.mark.parametrize("argv", [[], ["-m"], ["--nonsense", "x"]])
def test_the_launcher_answers_a_usage_error_with_status_2_and_the_usage(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: python -m elastic_ext.warm (-m MODULE | SCRIPT) [ARGS...]" in err
    assert "Traceback" not in err


# --- running a target as python would -----------------------------------------------


@pytest.mark.parametrize(("code", "status"), [
    (None, 0), (0, 0), (3, 3), (255, 255), (256, 0), (-1, 255), (True, 1), (False, 0),
    (2**40 + 3, 3), (2**100, 255), (-(2**100), 255),
])
def test_exit_code_of_matches_the_interpreter(code: object, status: int) -> None:
    assert exit_code_of(SystemExit(code)) == status


def test_exit_code_of_a_message_is_1_and_the_message_goes_to_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code_of(SystemExit("stopping: no data")) == 1
    assert capsys.readouterr().err == "stopping: no data\n"


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """``run_target`` sets ``sys.argv`` and ``sys.path[0]``: give it copies, and a module
    name of its own (a directory on ``sys.path``), removed from ``sys.modules`` after."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)  # a module target's sys.path[0]
    name = f"warm_unit_{uuid.uuid4().hex[:8]}"
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


RECORDS = ("import json, os, sys\n"
           "with open(os.environ['WARM_UNIT_OUT'], 'w') as f:\n"
           "    json.dump({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0]}, f)\n")


def test_a_script_runs_as_main_with_its_argv_and_its_directory_first_on_sys_path(
        isolated: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = write(tmp_path / "scripts" / "job.py", RECORDS + "sys.exit(int(sys.argv[1]))\n")
    monkeypatch.setenv("WARM_UNIT_OUT", str(tmp_path / "seen.json"))
    assert run_target(Target("path", str(script)), ["7", "--flag"]) == 7
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"name": "__main__", "argv": [str(script), "7", "--flag"],
                    "path0": str(tmp_path / "scripts")}


def test_a_module_runs_as_main_with_the_cwd_first_on_sys_path(
        isolated: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = write(tmp_path / isolated / "run.py", RECORDS)
    write(tmp_path / isolated / "__init__.py", "")
    monkeypatch.setenv("WARM_UNIT_OUT", str(tmp_path / "seen.json"))
    assert run_target(Target.module(f"{isolated}.run"), ["a"]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"name": "__main__", "argv": [str(module), "a"], "path0": str(tmp_path)}


def test_a_module_the_server_preloaded_runs_fresh_and_without_a_warning(
        isolated: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / isolated / "__init__.py", "")
    write(tmp_path / isolated / "run.py", RECORDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WARM_UNIT_OUT", str(tmp_path / "at-import.json"))
    __import__(f"{isolated}.run")  # what the server's preload does
    monkeypatch.setenv("WARM_UNIT_OUT", str(tmp_path / "seen.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # runpy's "found in sys.modules ... unpredictable"
        assert run_target(Target.module(f"{isolated}.run"), []) == 0
    assert json.loads((tmp_path / "seen.json").read_text())["name"] == "__main__"


@pytest.mark.parametrize(("body", "status", "says"), [
    ("pass\n", 0, ""),
    ("raise SystemExit(4)\n", 4, ""),
    ("raise SystemExit('no data')\n", 1, "no data\n"),
    ("raise ValueError('broken')\n", 1, "ValueError: broken"),
    ("import no_such_module_for_warm_tests\n", 1, "ModuleNotFoundError"),
    ("open('/no/such/file')\n", 1, "FileNotFoundError"),
])
def test_a_script_exits_with_the_status_python_gives(
        isolated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
        status: int, says: str) -> None:
    script = write(tmp_path / "job.py", body)
    assert run_target(Target("path", str(script)), []) == status
    err = capsys.readouterr().err
    assert says in err
    if status == 1 and says.endswith("\n"):
        assert "Traceback" not in err


def test_no_such_script_is_status_2_with_pythons_message(
        isolated: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.py"
    assert run_target(Target("path", str(missing)), []) == 2
    assert capsys.readouterr().err == (f"{sys.executable}: can't open file '{missing}': "
                                       "[Errno 2] No such file or directory\n")


def test_no_such_module_is_status_1_with_pythons_message(
        isolated: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_target(Target.module(isolated), []) == 1
    assert capsys.readouterr().err == f"{sys.executable}: No module named {isolated}\n"


def in_a_child(body: Callable[[], object]) -> int:
    """Run ``body`` in a forked child (which must end there); its raw wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(99)  # body returned or raised: not what the test expected
    _, status = os.waitpid(pid, 0)
    return status


def test_an_uncaught_keyboard_interrupt_runs_atexit_then_dies_of_sigint(
        isolated: str, tmp_path: Path) -> None:
    script = write(tmp_path / "job.py",
                   "import atexit, pathlib\n"
                   f"atexit.register(pathlib.Path({str(tmp_path / 'atexit-ran')!r}).touch)\n"
                   "raise KeyboardInterrupt\n")

    def child() -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # its traceback
        run_target(Target("path", str(script)), [])

    status = in_a_child(child)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status
    assert (tmp_path / "atexit-ran").exists()


def test_a_notice_before_the_scripts_own_handler_is_recorded_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR2 between the fork and the script's ``signal.signal``: the worker lives on and
    the notice goes to the agent; SIGTERM keeps python's default (death)."""
    monkeypatch.setenv(CONTROL_DIR_ENV, str(tmp_path))

    def notice_then_exit() -> None:
        set_worker_signals()
        signal.raise_signal(signal.SIGUSR2)  # the handler runs before this returns
        os._exit(0 if AgentControl(tmp_path).notice() else 3)

    def terminate() -> None:
        set_worker_signals()
        signal.raise_signal(signal.SIGTERM)

    assert in_a_child(notice_then_exit) == 0
    assert AgentControl(tmp_path).notice() == "SIGUSR2 to a worker before its handler"
    status = in_a_child(terminate)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


# --- the launcher's exit --------------------------------------------------------------


@pytest.mark.parametrize(("status", "exit_code", "signum"), [
    (0, 0, None),
    (3 << 8, 3, None),
    (255 << 8, 255, None),
    (signal.SIGTERM, None, signal.SIGTERM),
    (signal.SIGINT, None, signal.SIGINT),
    (signal.SIGUSR1, None, signal.SIGUSR1),
    (signal.SIGKILL, None, signal.SIGKILL),
    (signal.SIGSEGV | 0x80, None, signal.SIGSEGV),  # the worker dumped core
    (signal.SIGABRT, None, signal.SIGABRT),
    (signal.SIGSTOP, 128 + signal.SIGSTOP, None),  # garbled: no process ends by SIGSTOP
], ids=lambda v: str(v))
def test_the_launcher_leaves_as_its_worker_left(
        status: int, exit_code: int | None, signum: int | None) -> None:
    def child() -> None:
        # A launcher's signal handling at the end of a run: its own handlers and mask.
        signal.signal(signal.SIGTERM, lambda s, f: None)
        signal.signal(signal.SIGINT, lambda s, f: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        exit_with_status(status)

    got = in_a_child(child)
    if signum is None:
        assert os.WIFEXITED(got) and os.WEXITSTATUS(got) == exit_code, got
    else:
        assert os.WIFSIGNALED(got) and os.WTERMSIG(got) == signum, got
        assert not os.WCOREDUMP(got)  # one core (the worker's) is enough


# --- the launcher and a server ---------------------------------------------------------


class FakeServer:
    """A warm-start server that answers each request with the given replies."""

    def __init__(self, path: Path, replies: list[dict[str, Any]]) -> None:
        self.path = path
        self.replies = replies
        self.requests: list[tuple[dict[str, Any] | None, int]] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            message, fds = recv_message(conn, max_fds=3)
            for fd in fds:
                os.close(fd)
            self.requests.append((message, len(fds)))
            for reply in self.replies:
                send_message(conn, reply)

    def close(self) -> None:
        self._thread.join(10)
        self._listener.close()


@pytest.fixture
def fresh_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that has not gone cold yet, whose log ``caplog`` sees."""
    monkeypatch.setattr(launcher, "_went_cold", False)
    monkeypatch.setattr(logging.getLogger("elastic_ext"), "propagate", True)


def test_the_launcher_sends_its_process_and_returns_the_workers_status(
        tmp_path: Path, fresh_launcher: None) -> None:
    server = FakeServer(tmp_path / "sock", [{"pid": 4_194_999}, {"status": 3 << 8}])
    try:
        request = request_for(Target("path", "job.py"), ["--x"])
        assert Launch(str(server.path)).run(request) == 3 << 8
    finally:
        server.close()
    [(message, fds)] = server.requests
    assert fds == 3 and message is not None
    sent = RunRequest.from_message(message)
    assert sent == request
    assert (sent.env, sent.cwd) == (dict(os.environ), os.getcwd())
    assert sent.rlimits["RLIMIT_NOFILE"] == list(resource.getrlimit(resource.RLIMIT_NOFILE))


@pytest.mark.parametrize(("replies", "why"), [
    ([{"refused": "not safe to fork: CUDA was initialised at import"}], "CUDA was initialised"),
    ([], "closed the connection before forking"),
    ([{"pid": "not a pid"}], "not one of its protocol"),
])
def test_a_server_that_does_not_fork_sends_the_launcher_cold_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh_launcher: None,
        replies: list[dict[str, Any]], why: str) -> None:
    server = FakeServer(tmp_path / "sock", replies)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_ext.warm.launcher"):
            assert Launch(str(server.path)).run(request_for(Target("path", "j.py"), [])) is None
    finally:
        server.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and why in warned[0] and "starts cold" in warned[0], warned


def test_going_cold_warns_once_even_when_the_target_hands_off_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        fresh_launcher: None) -> None:
    """``-m elastic_ext.warm -m trainer`` without a server: the launcher goes cold, runs
    the trainer's ``__main__``, which hands off in turn: no second try, no second warning."""
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "no-server"))
    with caplog.at_level(logging.WARNING, logger="elastic_ext.warm.launcher"):
        hand_off(Target.module("trainer"), [])
        hand_off(Target.module("trainer"), [])
    assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.text
    assert "is not there" in caplog.text


@pytest.mark.parametrize("value", ["", OFF])
def test_warm_start_off_or_no_agent_runs_cold_without_a_word(
        value: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        fresh_launcher: None) -> None:
    monkeypatch.setenv(SOCKET_ENV, value)
    with caplog.at_level(logging.DEBUG, logger="elastic_ext.warm"):
        hand_off(Target.module("trainer"), [])
    assert caplog.records == []


def test_a_signal_that_came_before_going_cold_is_the_launchers_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_launcher: None) -> None:
    """A SIGUSR1 while the request was being sent: there is no worker to relay it to, so
    the launcher, now the worker itself, gets it once its own handler is back."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "sock"))
    listener.listen(1)
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))

    def sending_fails(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        raise BrokenPipeError("the server went away")

    monkeypatch.setattr(launcher, "send_message", sending_fails)
    try:
        assert Launch(str(tmp_path / "sock")).run(request_for(Target("path", "j.py"), [])) \
            is None
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        listener.close()


# --- settings ---------------------------------------------------------------------------


def settings(**conf: str) -> Any:
    return parse_settings(endpoint="c10d://127.0.0.1:29400", run_id="job", min_nodes=1,
                          max_nodes=1, conf=conf)


def test_warm_start_is_on_by_default_and_takes_on_or_off() -> None:
    assert settings().warm_start is True and settings().warm_preload == ()
    assert settings(warm_start="off").warm_start is False
    assert settings(warm_preload="numpy, mypkg.model").warm_preload == ("numpy", "mypkg.model")


def test_several_preload_modules_pass_torchruns_own_rdzv_conf_parser() -> None:
    """torchrun splits ``--rdzv-conf`` at every comma, so several modules are separated
    by colons; what its own parser (``_parse_rendezvous_config``) hands the plugin names
    them all."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    conf = _parse_rendezvous_config("warm_preload=numpy:mypkg.model,warm_start=on")
    assert settings(**conf).warm_preload == ("numpy", "mypkg.model")
    with pytest.raises(ValueError, match="'mypkg.model' must have a value"):
        _parse_rendezvous_config("warm_preload=numpy,mypkg.model")  # why commas cannot


@pytest.mark.parametrize(("conf", "says"), [
    ({"warm_start": "maybe"}, r"warm_start='maybe' must be on or off"),
    ({"warm_preload": "1bad"}, r"warm_preload: '1bad' is not a module name; give dotted names "
                               r"separated by colons, e\.g\. numpy:mypackage"),
    ({"warm_preload": "numpy,my-pkg"}, r"'my-pkg' is not a module name"),
])
def test_a_bad_warm_setting_names_the_fix(conf: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        settings(**conf)


class _FakeGuard:
    """A ``PreemptionGuard`` as the warm worker sees it: what it does with a fault."""

    def __init__(self, code: int | None) -> None:
        self.code = code
        self.seen: list[BaseException] = []

    def failure_exit_code(self, exc: BaseException) -> int:
        self.seen.append(exc)
        if self.code is None:
            raise exc
        return self.code


def test_a_fault_that_leaves_the_script_goes_to_the_guard_it_installed_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop on ElasticLoop lets its exceptions leave the script: the guard it installed
    (which keeps the step before holding) handles them, not the generic hold."""
    from elastic_ext.warm import worker
    from elastic_ext.worker import preemption

    fault = RuntimeError("Connection closed by peer")
    guard = _FakeGuard(143)
    monkeypatch.setattr(preemption, "_installed", guard)
    monkeypatch.setattr(worker, "hold_after_peer_fault", lambda exc: pytest.fail("generic hold"))

    def exit_now(code: int) -> None:  # the real one ends the process without a teardown
        raise SystemExit(code)
    monkeypatch.setattr(preemption, "exit_now", exit_now)
    with pytest.raises(SystemExit) as left:
        worker._uncaught(fault)
    assert left.value.code == 143 and guard.seen == [fault]
    printed: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: printed.append(exc))
    monkeypatch.setattr(preemption, "_installed", _FakeGuard(None))  # not a peer's fault
    assert worker._uncaught(fault) == 1 and printed == [fault]


def test_the_preload_takes_what_a_from_import_asks_of_a_lazy_package(tmp_path: Path) -> None:
    """``from elastic_ext import ElasticLoop`` loads ``elastic_ext.worker.loop`` only when asked
    (PEP 562), as transformers loads its models: the preload asks, before the fork."""
    import subprocess

    script = tmp_path / "uses_the_loop.py"
    script.write_text("from elastic_ext import ElasticLoop\nfrom elastic_ext import rendezvous\n")
    probe = ("import sys\nfrom elastic_ext.warm import preload\nfrom elastic_ext.warm.target "
             "import Target\n"
             f"loaded = preload.preload(Target('path', {str(script)!r}))\n"
             "print('elastic_ext.worker.loop' in sys.modules,"
             " 'elastic_ext.rendezvous' in sys.modules,"
             " [n for n in loaded if ':' in n])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=str(Path(__file__).parent.parent))
    assert done.stdout.strip() == "True True []", done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("source", [
    "import elastic_ext\n\ndef main():\n    return elastic_ext.ElasticLoop\n",
    "import elastic_ext as ee\nloop_class = ee.ElasticLoop\n",
    "import elastic_ext.worker.hold\nelastic_ext.worker.loop.elastic_loop.ElasticLoop\n",
])
def test_the_preload_takes_what_a_script_reads_from_a_lazy_package_after_import(
        tmp_path: Path, source: str) -> None:
    """``import transformers`` then ``transformers.Trainer``: the lazy package loads
    Trainer only when asked; the preload asks for every ``module.name`` the script reads
    of a module it imported (``elastic_ext.ElasticLoop`` stands in here)."""
    import subprocess

    script = tmp_path / "reads_the_loop.py"
    script.write_text(source)
    probe = ("import sys\nfrom elastic_ext.warm import preload\nfrom elastic_ext.warm.target "
             "import Target\n"
             f"preload.preload(Target('path', {str(script)!r}))\n"
             "print('elastic_ext.worker.loop.elastic_loop' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=str(Path(__file__).parent.parent))
    assert done.stdout.strip() == "True", done.stdout + done.stderr[-2000:]
