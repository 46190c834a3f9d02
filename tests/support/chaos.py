"""What the tests that play chaos scenarios share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_ext.chaos.runner import RunOptions, RunResult, run_scenario
from elastic_ext.chaos.scenario import parse
from elastic_ext.jsonlines import read_json_lines
from elastic_ext.worker.loop.data import position_after


def explain(result: RunResult, tail: int = 4000) -> str:
    """A failed scenario told for the assertion message: violations, then each log's end."""
    lines = [f"scenario {result.scenario.name}:"]
    if result.verdict is not None:
        lines += [f"  - {v}" for v in result.verdict.violations]
    for name, log in result.logs.items():
        text = log.read_text(errors="replace") if log.exists() else ""
        lines.append(f"===== {name} ({log}) =====\n{text[-tail:]}")
    return "\n".join(lines)


def run_program(text: str, name: str, program: Path, workdir: Path,
                extra: tuple[str, ...] = ()) -> RunResult:
    """Scenario ``text`` played against ``program`` (a script on ``ElasticLoop`` that
    speaks the trainer's flags and events, and ``extra`` flags of its own), after checking
    what every such run must show: no broken invariant, a restart, a last step, no step
    lost or trained twice."""
    result = run_scenario(parse(text, name),
                          RunOptions(workdir=workdir, module=str(program), reference=False,
                                     trainer_extra=extra))
    verdict = result.verdict
    assert not result.skipped, result.skipped
    assert verdict is not None and verdict.ok, explain(result)
    assert verdict.final_step is not None and verdict.restarts, explain(result)
    assert verdict.lost_steps == 0, explain(result)
    steps = [e["step"] for e in read_json_lines(workdir / "metrics.jsonl")
             if e["event"] == "step"]
    assert len(steps) == len(set(steps)), f"steps trained twice: {explain(result)}"
    return result


def rank0_then_preempt(steps: int) -> str:
    """The integrations' scenario: rank 0's machine dies (it hosts the workers' store and
    the metrics writer) under ``--max-restarts=0``; once the other trains on alone, the
    whole job is preempted and started again. Two nodes: a third would add a torchrun
    agent and a warm server (a framework's import each) to every round and prove nothing
    more. ``last_call_timeout=5``: the nodes started together form one round even on a
    busy machine."""
    return f"""\
nodes = 2
nnodes = 1:2
etcd-members = 1
max-restarts = 0
steps = {steps}
snapshot-every = 10
step-delay = 0.05
global-batch-size = 12
rdzv-conf = last_call_timeout=5
timeout = 300
at step 35: kill node rank0
when recovered: preempt all
when stopped: start all
"""


def check_rank0_then_preempt(result: RunResult, workdir: Path) -> list[dict[str, Any]]:
    """What ``rank0_then_preempt`` must show besides ``run_program``'s checks: the two
    machines, then one, then two again; the survivors' memory after the death; one
    preemption by SIGUSR2, and the restarted job at the very step it saved, from disk.
    Returns the metrics events."""
    assert worlds(result) == [2, 1, 2], explain(result)
    events = read_json_lines(workdir / "metrics.jsonl")
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == "SIGUSR2", explain(result)
    restored = [e for e in events if e["event"] == "restore"]
    assert [e["source"] for e in restored] == ["none", "local", "disk"], explain(result)
    assert restored[-1]["step"] == preempted[0]["step"], explain(result)
    return events


def check_every_step_on_its_data(events: list[dict[str, Any]], *, last: int, dataset_size: int,
                                 batches_per_step: int = 1, batch: int = 12) -> None:
    """Every step of ``events`` trained the batches an uninterrupted run gives it (the
    loop's exactly-once order, ``batch`` samples a batch, across epochs and world sizes),
    and the run ended at step ``last``."""
    steps = [e for e in events if e["event"] == "step"]
    assert steps and steps[-1]["step"] == last, steps[-1:]
    for event in steps:
        where = position_after(event["step"] * batches_per_step, batch, dataset_size)
        assert (event["epoch"], event["offset"]) == (where.epoch, where.offset), event


def worlds(result: RunResult) -> list[int]:
    """The world sizes the run trained at, in order, each once per stretch."""
    verdict = result.verdict
    assert verdict is not None
    seen: list[int] = []
    for segment in verdict.segments:
        if not seen or seen[-1] != segment.world_size:
            seen.append(segment.world_size)
    return seen
