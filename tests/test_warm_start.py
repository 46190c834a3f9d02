"""torchrun's worker contract holds when the etcd-ext agent's warm-start server forks the
workers (``torchrun ... -m elastic_ext.warm SCRIPT``): exit statuses and deaths by
signal, the signals torchrun sends, ``--redirects``/``--tee``/``--log-dir``, the error
file of ``@record``, and a restart's clean environment, working directory and limits;
below torchrun, the launcher's own limits and umask, and its cold start without a server.

Every script writes whether it ran in a forked worker (``in_warm_worker()``), and every
test checks it: a silent cold start would pass the rest."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.local.processes import Proc, ProcessSet, environ_of, wait_until
from elastic_ext.net import free_port
from elastic_ext.warm import SOCKET_ENV
from elastic_ext.warm.agent import WarmStartServer
from elastic_ext.warm.target import Target
from tests.support.trainer_runs import env, finish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

REPO = Path(__file__).parents[1]
SCRIPTS = REPO / "tests" / "support" / "warm_scripts"


def torchrun(script: str, *args: str, nproc: int = 2, max_restarts: int = 0,
             agent_args: tuple[str, ...] = (), as_module: bool = False) -> list[str]:
    """torchrun running ``script`` through the launcher; ``as_module``: as ``-m
    tests.support.warm_scripts.NAME``, to be run in the repository's root."""
    stem = Path(script).stem
    target = (["-m", f"tests.support.warm_scripts.{stem}"] if as_module
              else [str(SCRIPTS / script)])
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--rdzv-backend=etcd-ext",
            f"--rdzv-endpoint=c10d://127.0.0.1:{free_port('127.0.0.1')}",
            f"--rdzv-id=warm-{stem}", f"--max-restarts={max_restarts}",
            *agent_args, "-m", "elastic_ext.warm", *target, *args]


def facts(out: Path, what: str, rank: int | str, gen: int = 0) -> dict[str, Any]:
    data = json.loads((out / f"{what}-rank{rank}-gen{gen}.json").read_text())
    assert isinstance(data, dict)
    return data


def assert_warm(out: Path, what: str, ranks: int = 2, gen: int = 0) -> list[dict[str, Any]]:
    """Each rank's facts, after checking that a forked worker wrote them."""
    found = [facts(out, what, rank, gen) for rank in range(ranks)]
    for rank, fact in enumerate(found):
        assert fact["warm"], f"rank {rank} of generation {gen} ran cold: {fact}"
    return found


def wait_for_files(proc: Proc, paths: list[Path], what: str, timeout: float = 45) -> None:
    def there() -> bool:
        if all(p.exists() for p in paths):
            return True
        if proc.popen.poll() is not None:
            raise AssertionError(f"torchrun exited with {proc.popen.returncode} before {what}:\n"
                                 f"{proc.output()[-6000:]}")
        return False
    wait_until(there, timeout=timeout, what=what)


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def launchers(proc: Proc, expected: int, restart: int = 0) -> dict[int, int]:
    """rank -> pid of the launchers torchrun started (its children given a RANK)."""
    def look() -> dict[int, int] | None:
        found = {}
        for pid in proc.pids():
            given = environ_of(pid)
            if (parent_of(pid) == proc.pid and "RANK" in given
                    and given.get("TORCHELASTIC_RESTART_COUNT") == str(restart)):
                found[int(given["RANK"])] = pid
        return found if len(found) == expected else None
    return wait_until(look, timeout=30, what=f"{expected} launchers of restart {restart}")


@pytest.mark.parametrize(("how", "reported"), [
    ("3", r"exitcode\s*: 3 \(pid: (\d+)\)"),
    ("SIGKILL", r"exitcode\s*: -9 \(pid: (\d+)\).*\n.*\n\s*traceback : Signal 9 \(SIGKILL\)"),
    ("SIGSEGV", r"exitcode\s*: -11 \(pid: (\d+)\).*\n.*\n\s*traceback : Signal 11 \(SIGSEGV\)"),
], ids=["exit-3", "sigkill", "sigsegv"])
def test_torchrun_reports_the_workers_exit_code_or_signal(
        processes: ProcessSet, tmp_path: Path, how: str, reported: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = processes.spawn("torchrun", torchrun("warm_exit.py", str(out), how), env=env(),
                           cwd=tmp_path)
    assert finish(proc, 60) == 1, proc.output()[-4000:]
    output = proc.output()
    workers = assert_warm(out, "exit")
    match = re.search(reported, output)
    assert match, output[-4000:]
    # torchrun saw its launcher, not the forked worker: the status was handed on.
    assert int(match.group(1)) not in {w["pid"] for w in workers}
    assert "elastic_ext/warm/" not in output, output[-4000:]  # no launcher traceback


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2],
                         ids=lambda s: s.name)
def test_a_signal_torchrun_sends_a_launcher_reaches_the_workers_handler(
        processes: ProcessSet, tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = processes.spawn("torchrun", torchrun("warm_signals.py", str(out)), env=env(),
                           cwd=tmp_path)
    wait_for_files(proc, [out / f"ready-rank{r}-gen0.json" for r in range(2)], "workers ready")
    workers = assert_warm(out, "ready")
    found = launchers(proc, 2)
    for rank, launcher in found.items():
        assert workers[rank]["pid"] != launcher and workers[rank]["ppid"] != launcher
        os.killpg(launcher, sig)  # how torchrun's SubprocessHandler.close signals a worker
    assert finish(proc, 30) == 0, proc.output()[-4000:]
    for rank in range(2):
        got = facts(out, "got", rank)
        assert got["signal"] == sig.name and got["pid"] == workers[rank]["pid"]
    assert "Traceback" not in proc.output(), proc.output()[-4000:]
    assert "starts cold" not in proc.output()


@pytest.mark.parametrize(("mode", "as_module"), [("redirects", False), ("tee", True)],
                         ids=["redirects-script", "tee-module"])
def test_redirects_tee_and_log_dir_capture_the_workers_output(
        processes: ProcessSet, tmp_path: Path, mode: str, as_module: bool) -> None:
    """Also: a module target preloaded by the server runs without runpy's warning about
    a module found in ``sys.modules`` (``stderr.log`` holds only the worker's line)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    proc = processes.spawn("torchrun", torchrun(
        "warm_output.py", str(out), agent_args=(f"--{mode}", "3", "--log-dir", str(logs)),
        as_module=as_module), env=env(), cwd=REPO if as_module else tmp_path)
    assert finish(proc, 60) == 0, proc.output()[-4000:]
    assert_warm(out, "output")
    console = proc.output()
    for rank in range(2):
        stdout_logs = [p for p in logs.rglob("stdout.log") if p.parent.name == str(rank)]
        stderr_logs = [p for p in logs.rglob("stderr.log") if p.parent.name == str(rank)]
        assert len(stdout_logs) == len(stderr_logs) == 1, sorted(logs.rglob("*"))
        stdout, stderr = stdout_logs[0].read_text(), stderr_logs[0].read_text()
        assert stdout == f"warm-stdout-rank{rank}\nwarm-tail-rank{rank}", stdout
        assert stderr == f"warm-stderr-rank{rank}\n", stderr
        for line in (f"warm-stdout-rank{rank}", f"warm-stderr-rank{rank}"):
            shown = f"[default{rank}]:{line}\n" in console  # tee's prefix
            assert shown == (mode == "tee"), console[-4000:]


def test_the_error_file_of_record_reaches_torchruns_failure_report(
        processes: ProcessSet, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = processes.spawn("torchrun", torchrun("warm_error_file.py", str(out)), env=env(),
                           cwd=tmp_path)
    assert finish(proc, 60) == 1, proc.output()[-4000:]
    assert_warm(out, "error")
    report = proc.output().split("ChildFailedError")[-1]
    for rank in range(2):
        # The report quotes the error file's traceback only when the worker wrote one.
        assert f"ValueError: warm-marker-{rank}" in report, report
    assert "error_file: <N/A>" not in report, report


def test_a_restart_starts_from_torchruns_environment_cwd_umask_and_limits(
        processes: ProcessSet, tmp_path: Path) -> None:
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = (min(soft, 500), min(hard, 600))
    # torchrun's own limits and umask, set where nothing in the test process changes.
    lowered = [sys.executable, "-c",
               "import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, {nofile}); os.umask(0o027); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]
    cmd = lowered + torchrun("warm_env.py", str(out), max_restarts=1)[1:]
    proc = processes.spawn("torchrun", cmd, env=env(WARM_TEST_ONLY="set for torchrun"), cwd=cwd)
    wait_for_files(proc, [out / f"ready-rank{r}-gen1.json" for r in range(2)],
                   "the restarted workers")
    left = assert_warm(out, "left", gen=0)
    assert_warm(out, "ready", gen=1)
    given = {rank: environ_of(pid) for rank, pid in launchers(proc, 2, restart=1).items()}
    (out / "go").touch()
    assert finish(proc, 30) == 0, proc.output()[-4000:]
    found = assert_warm(out, "found", gen=1)
    for rank, fact in enumerate(found):
        assert fact["pid"] != left[rank]["pid"]
        environ, c_environ = fact["environ"], fact["c_environ"]
        assert environ["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert environ["WARM_TEST_ONLY"] == "set for torchrun"
        for name in ("LEFTOVER", "PUTENV_LEFTOVER"):
            assert name not in environ and name not in c_environ
        # Exactly what torchrun gave its worker process (the launcher): nothing of the
        # agent's or the server's that torchrun did not pass, nothing missing.
        assert environ == given[rank], set(environ.items()) ^ set(given[rank].items())
        assert c_environ == given[rank], set(c_environ.items()) ^ set(given[rank].items())
        assert fact["cwd"] == str(cwd)
        assert fact["umask"] == 0o027
        assert tuple(fact["nofile"]) == nofile


def test_a_warm_script_sees_the_sys_path_python_gives_it(
        processes: ProcessSet, tmp_path: Path) -> None:
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    proc = processes.spawn("torchrun", torchrun("warm_sys_path.py", str(out), nproc=1),
                           env=env(), cwd=cwd)
    assert finish(proc, 60) == 0, proc.output()[-4000:]
    warm = assert_warm(out, "sys-path", ranks=1)[0]
    cold_env = {k: v for k, v in env().items() if k != SOCKET_ENV}
    subprocess.run([sys.executable, "-u", str(SCRIPTS / "warm_sys_path.py"), str(out)],
                   env=cold_env, cwd=cwd, check=True, timeout=30)
    cold = facts(out, "sys-path", "cold")
    assert not cold["warm"]
    assert warm["sys_path"] == cold["sys_path"]


def test_several_preload_modules_reach_the_server_through_torchruns_rdzv_conf(
        processes: ProcessSet, tmp_path: Path) -> None:
    """``--rdzv-conf warm_preload=A:B`` passes torchrun's own parser (which splits at
    commas) and the server imports both before it forks: the worker finds them loaded
    (neither is imported by the script, the launcher or torch)."""
    out = tmp_path / "out"
    out.mkdir()
    wanted = ["xml.dom.minidom", "wsgiref.simple_server"]
    proc = processes.spawn("torchrun", torchrun(
        "warm_preloaded.py", str(out), *wanted, "unloaded.nothing", nproc=1,
        agent_args=(f"--rdzv-conf=warm_preload={':'.join(wanted)}",)), env=env())
    assert finish(proc, 60) == 0, proc.output()[-4000:]
    assert assert_warm(out, "preloaded", ranks=1)[0]["loaded"] == wanted


def test_the_launcher_hands_its_own_limits_umask_cwd_and_streams_to_the_worker(
        processes: ProcessSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below torchrun: the server here has this test's limits and umask, the launcher
    others of its own, which its worker must have."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("RANK", "0")  # for the server's environment: not the worker's
    server = WarmStartServer(Target("path", str(SCRIPTS / "warm_env.py")))
    try:
        launcher_env = {k: v for k, v in env().items() if k != "RANK"}
        launcher_env.update({SOCKET_ENV: server.socket_path, "RANK": "5",
                             "TORCHELASTIC_RESTART_COUNT": "1", "WARM_TEST_ONLY": "launcher"})
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        nofile = (min(soft, 300) - 1, min(hard, 400) - 1)
        cmd = [sys.executable, "-c",
               "import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, {nofile}); os.umask(0o077); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
               "-u", "-m", "elastic_ext.warm", str(SCRIPTS / "warm_env.py"), str(out)]
        (out / "go").touch()
        proc = processes.spawn("launcher", cmd, env=launcher_env, cwd=cwd)
        assert finish(proc, 30) == 0, proc.output()[-4000:]
    finally:
        server.close()
    fact = facts(out, "found", 5, gen=1)
    assert fact["warm"], fact
    assert fact["ppid"] == server.pid
    assert fact["umask"] == 0o077 and tuple(fact["nofile"]) == nofile
    assert fact["cwd"] == str(cwd)
    assert fact["environ"]["RANK"] == "5" and fact["environ"]["WARM_TEST_ONLY"] == "launcher"
    assert fact["environ"] == fact["c_environ"]
    assert "starts cold" not in proc.output()


def test_without_a_server_the_launcher_runs_the_script_cold_with_one_warning(
        processes: ProcessSet, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-u", "-m", "elastic_ext.warm", str(SCRIPTS / "warm_exit.py"),
           str(out), "3"]
    proc = processes.spawn("launcher", cmd, env=env(**{SOCKET_ENV: str(tmp_path / "no-such"),
                                                      "RANK": "0"}))
    assert finish(proc, 30) == 3, proc.output()
    assert not facts(out, "exit", 0)["warm"]
    assert proc.output().count("starts cold") == 1, proc.output()
