"""No CUDA driver before the fork (issue 24): ``torch.cuda.is_available()`` at import time
loads ``libcuda`` without ``torch.cuda.is_initialized()`` saying so, and every forked
worker's first CUDA call then fails. The server asks torch to use NVML instead
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``) and refuses to fork once the driver is mapped,
naming the import that loaded it.

No GPU here: a stand-in shared library named like the driver (``libcuda.so.1``), loaded
with ``ctypes`` by a module the server preloads, is what ``/proc/self/maps`` shows of a
real driver."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_ext.local.processes import ProcessSet
from elastic_ext.warm import SOCKET_ENV, server
from elastic_ext.warm.agent import WarmStartServer
from elastic_ext.warm.safety import (
    NVML_CUDA_CHECK_ENV,
    ForkSafety,
    cuda_driver_loaded,
)
from elastic_ext.warm.status import query_status
from elastic_ext.warm.target import Target
from tests.support.trainer_runs import env, finish

REPO = Path(__file__).parents[1]
STAND_IN_ENV = "WARM_TEST_STAND_IN_DRIVER"
RECORD_ENV = "WARM_TEST_RECORD_DIR"


# -- the maps parser ------------------------------------------------------------------------
def maps_line(path: str = "") -> str:
    return f"7f3a1c000000-7f3a1c021000 r-xp 00000000 08:01 1048602                    {path}"


@pytest.mark.parametrize("path", [
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
    "/usr/lib64/libcuda.so.550.54",
    "/opt/a dir with spaces/libcuda.so",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1 (deleted)",  # upgraded on disk, still mapped
])
def test_a_mapping_of_the_driver_is_the_driver_loaded(path: str) -> None:
    text = "\n".join([maps_line("/usr/bin/python3.11"), maps_line(path), maps_line("[heap]")])
    assert cuda_driver_loaded(text)


@pytest.mark.parametrize("path", [
    "/opt/conda/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
    "/usr/local/cuda/lib64/libcudart.so",
    "/usr/lib/x86_64-linux-gnu/libcudadebugger.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",  # what the NVML check loads: fork-safe
    "/home/me/libcuda.so.1/not-the-driver.so",  # only the file's own name counts
    "[anon:libcuda.so]",
    "",
])
def test_the_runtime_nvml_and_other_names_are_not_the_driver(path: str) -> None:
    text = "\n".join([maps_line("/usr/bin/python3.11"), maps_line(path), maps_line("[stack]")])
    assert not cuda_driver_loaded(text)


def test_no_maps_is_no_driver() -> None:
    assert not cuda_driver_loaded("")


# -- the hazard's words ---------------------------------------------------------------------
def facts(**changes: object) -> ForkSafety:
    fields: dict[str, object] = dict(threads=4, allowed_threads=4, python_threads=[],
                                     cuda_initialized=False, process_group=False)
    fields.update(changes)
    return ForkSafety(**fields)  # type: ignore[arg-type]


def test_a_loaded_driver_is_a_hazard_that_names_its_import_and_the_fix() -> None:
    [hazard] = facts(cuda_driver=True, cuda_import="mypackage.devices").hazards
    assert "the CUDA driver was loaded while importing mypackage.devices" in hazard
    assert "torch.cuda.is_available()) into main()" in hazard
    assert "warm_start=off" in hazard


def test_torch_saying_cuda_is_initialised_is_the_same_hazard() -> None:
    [hazard] = facts(cuda_initialized=True).hazards
    assert hazard.startswith("the CUDA driver was loaded before the fork")
    [both] = facts(cuda_initialized=True, cuda_driver=True, cuda_import="m").hazards
    assert "while importing m" in both


def test_no_driver_no_hazard() -> None:
    assert facts().hazards == []


# -- the server's environment ---------------------------------------------------------------
def test_the_server_sets_the_nvml_check_and_keeps_a_value_it_was_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NVML_CUDA_CHECK_ENV, raising=False)
    server.use_nvml_cuda_check()
    assert os.environ[NVML_CUDA_CHECK_ENV] == "1"
    monkeypatch.setenv(NVML_CUDA_CHECK_ENV, "0")
    server.use_nvml_cuda_check()
    assert os.environ[NVML_CUDA_CHECK_ENV] == "0"


@pytest.mark.timeout(30)
def test_the_servers_own_imports_do_not_import_torch() -> None:
    """``main`` sets the variable first: before torch only if nothing before it imports it."""
    probe = "import sys, elastic_ext.warm.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=20, check=True)
    assert out.stdout.strip() == "False", out


# -- a real server, a module that loads the "driver" at import ------------------------------
@pytest.fixture(scope="module")
def stand_in_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loadable shared library named ``libcuda.so.1`` (a compiled stub, or a copy of
    Python's ``_ctypes`` extension where there is no C compiler)."""
    directory = tmp_path_factory.mktemp("stand-in-driver")
    library = directory / "libcuda.so.1"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is not None:
        source = directory / "stand_in.c"
        source.write_text("int elastic_ext_stand_in_driver(void) { return 24; }\n")
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)],
                       check=True, timeout=60, capture_output=True)
    else:
        import _ctypes

        origin = getattr(_ctypes, "__file__", None)
        if not origin:
            pytest.skip("no C compiler and no shared library to copy as a stand-in driver")
        shutil.copy(origin, library)
    return library


PROBE = """\
    import ctypes
    import json
    import os

    # What torch.cuda.is_available() does without NVML: load the driver, at import time.
    ctypes.CDLL(os.environ["WARM_TEST_STAND_IN_DRIVER"])
    with open(os.path.join(os.environ["WARM_TEST_RECORD_DIR"], f"import-{os.getpid()}.json"),
              "w") as f:
        json.dump({"nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}, f)
"""
JOB = """\
    import json
    import os
    import sys

    import warm_test_plain  # noqa: F401
    import warm_test_cuda_probe  # noqa: F401  (loads the "driver" at import)
    from elastic_ext.warm.worker import in_warm_worker

    if __name__ == "__main__":
        with open(os.path.join(sys.argv[1], "worker.json"), "w") as f:
            json.dump({"warm": in_warm_worker(), "pid": os.getpid()}, f)
        print("cuda job ran", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_module_that_loads_the_driver_at_import_is_not_forked_and_its_worker_runs_cold(
        processes: ProcessSet, tmp_path: Path, stand_in_driver: Path,
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One warning from the server at its start and one from the launcher, both naming the
    import; the worker runs (cold); the server's imports ran with the NVML check on."""
    job_dir, out = tmp_path / "job", tmp_path / "out"
    job_dir.mkdir()
    out.mkdir()
    (job_dir / "warm_test_plain.py").write_text("VALUE = 1\n")
    (job_dir / "warm_test_cuda_probe.py").write_text(textwrap.dedent(PROBE))
    script = job_dir / "warm_test_cuda_job.py"
    script.write_text(textwrap.dedent(JOB))
    # The agent's environment, which the server inherits: no NVML check of its own.
    monkeypatch.delenv(NVML_CUDA_CHECK_ENV, raising=False)
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    monkeypatch.setenv(STAND_IN_ENV, str(stand_in_driver))
    monkeypatch.setenv(RECORD_ENV, str(out))
    warm = WarmStartServer(Target("path", str(script)))
    try:
        assert warm.wait_ready(30), "the warm-start server did not become ready"
        status = query_status(warm.socket_path, 10)
        assert status is not None
        assert status["cuda_driver"] is True and status["cuda_import"] == "warm_test_cuda_probe"
        assert status["cuda_initialized"] is False, status  # what torch alone would miss
        launcher_env = env(**{SOCKET_ENV: warm.socket_path, "RANK": "0"})
        launcher_env.pop(NVML_CUDA_CHECK_ENV, None)
        launcher = processes.spawn("launcher", [sys.executable, "-u", "-m", "elastic_ext.warm",
                                                str(script), str(out)],
                                   env=launcher_env, cwd=tmp_path)
        assert finish(launcher, 30) == 0, launcher.output()[-4000:]
    finally:
        warm.close()
    server_log = capfd.readouterr().err
    said = launcher.output()

    worker = json.loads((out / "worker.json").read_text())
    assert worker == {"warm": False, "pid": launcher.pid}, worker  # run cold, by the launcher
    assert "cuda job ran" in said

    hazard = "the CUDA driver was loaded while importing warm_test_cuda_probe"
    cold = re.findall(r"etcd-ext warm start: .*; this worker starts cold", said)
    assert len(cold) == 1 and hazard in cold[0] and "not safe to fork" in cold[0], said
    warned = re.findall(r"warm-start server WARNING: .*", server_log)
    assert len(warned) == 1 and hazard in warned[0], server_log
    assert "Traceback" not in said and "Traceback" not in server_log, (said, server_log)

    # The server imported the module with the NVML check on (set by the server itself,
    # before any import); the worker got its launcher's environment, without it.
    in_server = json.loads((out / f"import-{warm.pid}.json").read_text())
    assert in_server == {"nvml_check": "1"}, in_server
    in_worker = json.loads((out / f"import-{launcher.pid}.json").read_text())
    assert in_worker["nvml_check"] is None, in_worker
