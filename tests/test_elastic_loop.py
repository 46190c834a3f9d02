"""``ElasticLoop`` in one plain process (a one-rank gloo group, no launcher): the order of
its calls, resume with exactly-once data, the events, and errors that are not a peer's.

The multi-node behaviour (hand-off, stops, dead peers) is proven by the chaos runs of
``examples/own_loop.py`` (``test_own_loop.py``) and by the bundled trainer's tests, which
runs on the same object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from elastic_ext.worker.loop.data import DataPosition, next_batch

JOB = Path(__file__).parent / "support" / "elastic_loop_job.py"
ROOT = Path(__file__).parent.parent


def run_job(directory: Path, run_id: str | None = None,
            **spec: Any) -> subprocess.CompletedProcess[str]:
    """``elastic_loop_job.py`` with ``spec``, as run ``run_id`` (torchrun's run id) if given."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_EXT_", "TORCHELASTIC_", "MASTER_", "RANK"))}
    env["PYTHONPATH"] = str(ROOT)
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    return subprocess.run([sys.executable, str(JOB), json.dumps({"dir": str(directory), **spec})],
                          env=env, capture_output=True, text=True, timeout=120)


def steps_of(done: subprocess.CompletedProcess[str]) -> dict[int, list[int]]:
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return {line["step"]: line["ids"] for line in lines}


def uninterrupted_ids(steps: int, dataset: int) -> dict[int, list[int]]:
    """The sample ids of each step of an uninterrupted run of ``run_job`` (seed 1, batches
    of 4), epochs included."""
    ids: dict[int, list[int]] = {}
    position = DataPosition()
    for step in range(1, steps + 1):
        batch, position = next_batch(position, 1, 4, dataset)
        ids[step] = batch.tolist()
    return ids


def events(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]


def test_a_run_stopped_and_resumed_trains_every_step_once_on_the_uninterrupted_data(
        tmp_path: Path) -> None:
    first = run_job(tmp_path, steps=7, dataset=10)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_job(tmp_path, steps=11, dataset=10)
    assert second.returncode == 0, second.stderr[-3000:]
    trained = {**steps_of(first), **steps_of(second)}
    assert sorted(steps_of(first)) == list(range(1, 8))
    assert sorted(steps_of(second)) == list(range(8, 12))  # from the final snapshot of 7
    assert trained == uninterrupted_ids(steps=11, dataset=10)
    log = events(tmp_path)
    kinds = [(e["event"], e["step"]) for e in log if e["event"] != "step"]
    assert kinds[:2] == [("start", 0), ("restore", 0)]
    assert ("snapshot", 3) in kinds and ("snapshot", 6) in kinds and ("done", 7) in kinds
    assert ("start", 7) in kinds and ("done", 11) in kinds
    restore = next(e for e in log if e["event"] == "restore" and e["step"] == 7)
    assert restore["source"] == "disk"
    assert next(e for e in log if e["event"] == "done")["note"] == "finished"


def test_another_dataset_is_refused_naming_both(tmp_path: Path) -> None:
    assert run_job(tmp_path, steps=2, dataset=10).returncode == 0
    done = run_job(tmp_path, steps=4, dataset=12)
    assert done.returncode != 0
    assert "dataset size 10; this run has 1 and 12" in done.stderr, done.stderr[-2000:]


def test_a_snapshot_of_another_run_is_refused_unless_the_loop_resumes_other_runs(
        tmp_path: Path) -> None:
    """A second run pointed at the first one's directory does not train on from its weights
    without a word; the same run id (a requeued job) and ``resume_other_runs`` go on."""
    assert run_job(tmp_path, run_id="first", steps=2, dataset=10).returncode == 0
    refused = run_job(tmp_path, run_id="second", steps=4, dataset=10)
    assert refused.returncode != 0
    assert "was written by run 'first', and this is run 'second'" in refused.stderr, \
        refused.stderr[-2000:]
    assert "snapshots/second" in refused.stderr and "resume_other_runs=True" in refused.stderr
    assert steps_of(refused) == {}  # not one step trained on the other run's weights
    same = run_job(tmp_path, run_id="first", steps=3, dataset=10)
    assert same.returncode == 0, same.stderr[-2000:]
    assert sorted(steps_of(same)) == [3]
    other = run_job(tmp_path, run_id="second", steps=4, dataset=10, resume_other_runs=True)
    assert other.returncode == 0, other.stderr[-2000:]
    assert sorted(steps_of(other)) == [4]
    # and from then on the snapshots are run 'second''s
    assert run_job(tmp_path, run_id="second", steps=5, dataset=10).returncode == 0
    # torchrun --standalone makes up an id for every launch: it names no job
    made_up = run_job(tmp_path, run_id="5d101506-92d9-468a-be38-db9d13e653cc", steps=6,
                      dataset=10)
    assert made_up.returncode == 0 and sorted(steps_of(made_up)) == [6], made_up.stderr[-2000:]


def test_an_error_that_is_not_a_peers_fault_ends_the_process_with_its_traceback(
        tmp_path: Path) -> None:
    done = run_job(tmp_path, steps=5, dataset=10, raise_at=3)
    assert done.returncode == 1
    assert "RuntimeError: a bug in the training code" in done.stderr
    assert sorted(steps_of(done)) == [1, 2]


def test_an_update_split_over_two_calls_counts_like_one_and_a_fault_inside_keeps_nothing(
        tmp_path: Path) -> None:
    """``begin_update``/``end_update`` (a framework's callbacks before and after the
    update, the first one called twice in a step as under LBFGS): the same steps as
    ``update()`` (the uninterrupted order, which the first test proves ``update()`` takes),
    and a peer's fault between the two lets go of the update's lock before the keep takes
    it (no deadlock) and keeps no half update."""
    split = run_job(tmp_path / "split", steps=5, dataset=10, split_update=True)
    assert split.returncode == 0, split.stderr[-3000:]
    assert steps_of(split) == uninterrupted_ids(steps=5, dataset=10)
    faulted = run_job(tmp_path / "fault", steps=5, dataset=10, split_update=True,
                      fault_in_update_at=3)
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    assert '{"kept_at": null}' in faulted.stdout, faulted.stdout  # step 3 was half applied
    assert "not keeping the state: an update was being applied" in faulted.stderr
    fault = [e for e in events(tmp_path / "fault") if e["event"] == "fault"]
    assert [(e["step"], e["kept"]) for e in fault] == [(2, None)], fault


LOOP_SURFACE = ["batches", "device", "device_ids", "finish", "framework", "mesh",
                "no_hang_check", "rank", "restore", "step", "step_done", "update", "world_size"]
"""What a training loop calls, and nothing else: a name added here is an API promise."""

FRAMEWORK_SURFACE = ["abandon_update", "batch_sampler", "batch_started", "begin_update",
                     "close", "closed", "end_update", "exit_on_peer_fault", "fail",
                     "global_ids", "held_step", "next_position", "pause_hang_check", "restored",
                     "restored_age_s", "resumed_from", "start_data", "track", "updating"]
"""``loop.framework``: what only integrations, the bundled trainer and the sampler call."""


def test_the_public_surface_is_what_a_loop_calls_and_the_framework_hooks() -> None:
    """The class's names (methods, properties) cannot grow without this list."""
    from elastic_ext.worker.loop import ElasticLoop
    from elastic_ext.worker.loop.elastic_loop import FrameworkHooks

    assert sorted(n for n in dir(ElasticLoop) if not n.startswith("_")) == LOOP_SURFACE
    assert sorted(n for n in dir(FrameworkHooks) if not n.startswith("_")) == FRAMEWORK_SURFACE
    for name in ("device", "device_ids", "rank", "world_size", "step", "framework"):
        attribute = getattr(ElasticLoop, name)
        assert isinstance(attribute, property) and attribute.fset is None, name  # read-only


def test_a_live_loop_has_no_public_attribute_beyond_its_surface(tmp_path: Path) -> None:
    """Nor can an instance attribute set in ``__init__`` make it grow."""
    done = run_job(tmp_path, surface=True)
    assert done.returncode == 0, done.stderr[-3000:]
    surface = json.loads(done.stdout.splitlines()[-1])
    assert surface == {"loop": LOOP_SURFACE, "framework": FRAMEWORK_SURFACE}
