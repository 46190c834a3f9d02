"""A sharded loop's bad inputs get a message that names the fix, before anything trains."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_ext.worker.loop.sharding import round_mesh

ROOT = Path(__file__).resolve().parent.parent


def test_an_hsdp_mesh_over_an_uneven_world_is_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"world size 3 is not a whole number of nodes of "
                                         r"LOCAL_WORLD_SIZE=2: start every node with the same "
                                         r"--nproc-per-node, or call mesh\(\) without hsdp"):
        round_mesh("cpu", 3, hsdp=True)


SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic_ext.worker.loop.sharding import sharded_state_for
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    fully_shard(a, mesh=mesh)
    {second}
    try:
        sharded_state_for({{"a": a, "b": b}}, snapshot_dir=None, copy_every=1,
                          keep_snapshots=1)
    except ValueError as exc:
        print("refused:", exc)
""")


@pytest.mark.parametrize("second", ["fully_shard(b, mesh=mesh)", "pass"],
                         ids=["two-sharded", "sharded-and-plain"])
def test_restore_given_two_models_of_which_one_is_sharded_names_the_fix(second: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(second=second)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: restore() got sharded modules ['a" in done.stdout, done.stdout
    assert "name one model, the root module you called fully_shard on" in done.stdout
