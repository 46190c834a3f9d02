"""``elastic-ext report``: the analysis of a metrics file, the command, and one real run.

Everything but the last test works on made-up event lists and files, in milliseconds.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.local.processes import ProcessSet
from elastic_ext.ops import report
from elastic_ext.ops.cli import main as cli_main
from elastic_ext.ops.runlog import (
    RESTORE_SOURCES,
    RestoreSource,
    RunLogError,
    parse_events,
    summarize,
    with_agent_events,
)
from tests.support.trainer_runs import (
    BASE_ARGS,
    env,
    finish,
    of,
    run_to_end,
    trainer_cmd,
    wait_event,
)

pytestmark = pytest.mark.timeout(60)


def ev(kind: str, step: int, t: float, world: int = 3, **extra: Any) -> dict[str, Any]:
    return {"event": kind, "step": step, "world_size": world, "restart": 0, "time": 1000.0 + t,
            **extra}


def three_rounds() -> list[dict[str, Any]]:
    """Round 1 (world 3) from scratch: steps 1-47 at t=2..6.6, then silence (a killed node).
    Round 2 (world 2) from the snapshot of 40 at t=10: steps 41-60 at t=11..12.9, stopped by
    SIGTERM (a node joins). Round 3 (world 3) from 60 at t=15: steps 61-80 at t=16..17.9, done.
    """
    events = [ev("start", 0, 0.0, resumed_from=None)]
    for s in range(1, 48):
        events.append(ev("step", s, 2.0 + (s - 1) * 0.1, loss=1.0 / s))
        if s % 10 == 0:
            events.append(ev("snapshot", s, 2.05 + (s - 1) * 0.1, blocking_s=0.01))
    events.append(ev("start", 40, 10.0, world=2, resumed_from=40))
    events += [ev("step", s, 11.0 + (s - 41) * 0.1, world=2, loss=1.0 / s) for s in range(41, 61)]
    events += [ev("snapshot", 60, 13.0, world=2), ev("preempted", 60, 13.1, world=2,
                                                     signal="SIGTERM")]
    events.append(ev("start", 60, 15.0, resumed_from=60))
    events += [ev("step", s, 16.0 + (s - 61) * 0.1, loss=1.0 / s) for s in range(61, 81)]
    events += [ev("snapshot", 80, 18.0), ev("done", 80, 18.5, params_sha256="ab" * 32)]
    return events


def handed_off() -> list[dict[str, Any]]:
    """The same run with the state hand-off: round 2 starts from step 47 that its nodes
    kept in memory, round 3 from a peer's copy of the step round 2 stopped at for the join."""
    events = [ev("start", 0, 0.0, resumed_from=None), ev("restore", 0, 0.0, source="none")]
    events += [ev("step", s, 2.0 + (s - 1) * 0.1, loss=1.0 / s) for s in range(1, 48)]
    events.append(ev("fault", 47, 6.7, why="a collective failed", kept=47))
    events += [ev("start", 47, 7.0, world=2, resumed_from=47),
               ev("restore", 47, 7.0, world=2, source="local", bytes=100, seconds=0.01)]
    events += [ev("step", s, 8.0 + (s - 48) * 0.1, world=2, loss=1.0 / s) for s in range(48, 61)]
    events.append(ev("stopped", 60, 9.5, world=2, reason="membership", kept=60))
    events += [ev("start", 60, 10.0, resumed_from=60),
               ev("restore", 60, 10.0, source="peer", bytes=100, seconds=0.02)]
    events += [ev("step", s, 11.0 + (s - 61) * 0.1, loss=1.0 / s) for s in range(61, 81)]
    events.append(ev("done", 80, 13.5, params_sha256="ab" * 32))
    return events


def test_a_run_with_state_handed_off_between_rounds() -> None:
    summary = summarize(handed_off())
    assert [(r.source, r.step) for r in summary.restores] == [
        ("fresh", 0), ("local", 47), ("peer", 60)]
    assert summary.restores[2].description == "state from a peer at step 60"
    assert [s.end for s in summary.segments] == ["cut", "stopped", "done"]
    assert [m.label for m in summary.faults] == ["round 1 cut at step 47"]
    assert [m.label for m in summary.new_rounds] == ["new round at step 60"]
    assert summary.preemptions == () and summary.steps_redone == 0
    text = report.as_text(summary, Path("m.jsonl"))
    assert "stopped at step 60 for a new round (membership)" in text
    assert "new rounds at a step boundary: 1" in text


def write(path: Path, events: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return path


# ----------------------------------------------------------------------------- analysis
def test_the_summary_of_a_kill_and_a_join() -> None:
    summary = summarize(three_rounds())
    assert summary.rounds == 3
    assert [s.world_size for s in summary.segments] == [3, 2, 3]
    assert [(r.source, r.step, r.description) for r in summary.restores] == [
        ("fresh", 0, "fresh start"), ("snapshot", 40, "snapshot at step 40"),
        ("snapshot", 60, "snapshot at step 60")]
    assert summary.restores_by_source() == {"fresh": 1, "snapshot": 2}
    assert [m.label for m in summary.faults] == ["round 1 cut at step 47"]
    assert summary.faults[0].time == pytest.approx(1006.6)  # its last event
    assert [m.label for m in summary.preemptions] == ["stopped at step 60 by SIGTERM"]
    assert summary.steps_redone == 7  # 41-47
    assert [b.lost for b in summary.boundaries] == [7, 0]
    assert summary.startup_s == pytest.approx(2.0)
    assert summary.gaps_s == pytest.approx((11.0 - 6.6, 16.0 - 12.9))
    assert summary.not_training_s == pytest.approx(2.0 + 4.4 + 3.1)
    assert summary.total_s == pytest.approx(18.5)
    assert (summary.finished, summary.final_step, summary.last_step) == (True, 80, 80)
    assert summary.params_sha256 == "ab" * 32


def test_marks_cover_every_round_restore_preemption_and_fault_in_time_order() -> None:
    marks = summarize(three_rounds()).marks()
    assert [m.kind for m in marks] == ["round", "fault", "round", "recovery", "preempted",
                                       "round", "recovery"]
    assert [m.time - 1000.0 for m in marks] == pytest.approx([0.0, 6.6, 10.0, 11.0, 13.1, 15.0,
                                                              16.0])
    assert marks[2].label == "round 2: world 2, snapshot at step 40"


def test_steps_trained_twice_count_every_repeat() -> None:
    """Killed at 17 and again at 12, both times back to the snapshot of 10: 7 + 2 redone."""
    events = [ev("start", 0, 0.0, resumed_from=None)]
    events += [ev("step", s, float(s)) for s in range(1, 18)]
    events += [ev("snapshot", 10, 10.5), ev("start", 10, 30.0, resumed_from=10)]
    events += [ev("step", s, 20.0 + s) for s in (11, 12)]
    events += [ev("start", 10, 40.0, resumed_from=10)]
    events += [ev("step", s, 30.0 + s) for s in range(11, 21)]
    summary = summarize(events)
    assert summary.steps_redone == 9
    assert [b.lost for b in summary.boundaries] == [7, 2]
    assert len(summary.faults) == 2 and not summary.finished
    assert summary.gaps_s == pytest.approx((31.0 - 17.0, 41.0 - 32.0))


def test_a_run_still_going_has_no_fault_for_its_last_round_and_a_fresh_restart() -> None:
    events = [ev("start", 0, 0.0, resumed_from=None), ev("step", 1, 1.0), ev("step", 2, 2.0),
              ev("start", 0, 5.0, resumed_from=None), ev("step", 1, 6.0)]
    summary = summarize(events)
    assert [r.description for r in summary.restores] == ["fresh start", "fresh start"]
    assert summary.restores_by_source() == {"fresh": 2}
    assert len(summary.faults) == 1 and summary.steps_redone == 1
    assert summary.last_step == 2 and summary.final_step is None
    assert [m.kind for m in summary.marks()] == ["round", "fault", "round", "recovery"]


def test_events_before_the_first_start_and_a_round_without_steps() -> None:
    events = [ev("step", 9, -1.0), ev("start", 0, 0.0, resumed_from=None),
              ev("start", 0, 3.0, resumed_from=None), ev("step", 1, 4.0)]
    summary = summarize(events)
    assert summary.ignored == 1 and summary.rounds == 2
    assert summary.startup_s == pytest.approx(4.0) and summary.gaps_s == ()


def test_another_restore_source_is_one_more_entry() -> None:
    """The planned state hand-off between peers: recognised from what its start event adds."""
    peer = RestoreSource("peer", lambda start: start.get("restored_by") == "peer",
                         lambda start: f"state from a peer at step {start['resumed_from']}")
    events = three_rounds()
    events[next(i for i, e in enumerate(events) if e.get("resumed_from") == 40)][
        "restored_by"] = "peer"
    summary = summarize(events, sources=(peer, *RESTORE_SOURCES))
    assert [r.source for r in summary.restores] == ["fresh", "peer", "snapshot"]
    assert summary.restores[1].description == "state from a peer at step 40"


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("\n  \n", "is empty"),
    ("step,loss\n1,0.5\n", "line 1 is not JSON"),
    ("[1, 2]\n", "line 1 is not a JSON object"),
    ('{"event": "step", "step": 1}\n', "line 1 lacks world_size, time"),
    (json.dumps(ev("step", 1, 1.0)) + "\n", "has no 'start' event"),
    (json.dumps({**ev("start", 0, 1.0), "step": "0", "resumed_from": "3"}) + "\n",
     "line 1: step must be an integer, resumed_from must be an integer or null"),
    (json.dumps(ev("step", 1, 1.0, loss="nan")) + "\n", "line 1: loss must be a number or null"),
])
def test_bad_text_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(RunLogError, match="m.jsonl") as info:
        parse_events(text, "m.jsonl")
    assert message in str(info.value)


def test_lines_torn_by_a_crash_are_skipped_and_counted() -> None:
    events = three_rounds()
    text = "".join(json.dumps(e) + "\n" for e in events[:5]) + '{"event": "st\n' + \
        "".join(json.dumps(e) + "\n" for e in events[5:]) + '{"event": "do'
    parsed, unreadable = parse_events(text)
    assert parsed == events and unreadable == [6, len(events) + 2]


def slow(t: float, peer: str = "node-b", dropped: bool = True, **extra: Any) -> dict[str, Any]:
    """A ``slow`` event of an agent's events file (``rendezvous/agent/events.py``)."""
    return {"time": 1000.0 + t, "run_id": "r", "node": "node-a", "pid": 7, "event": "slow",
            "message": f"{peer} is a straggler", "peer": peer, "own_s": 0.3, "others_s": 0.1,
            "step_s": 0.3, "gain": 1.4, "dropped": dropped, **extra}


def agent_events() -> list[dict[str, Any]]:
    """node-a's events: node-b named slow in round 2 and left out; node-c named slow in
    round 3 and kept; one straggler of a run long before; other kinds; a malformed one."""
    return [{"time": 1000.0, "event": "joined", "node": "node-a", "round": 1},
            slow(12.0), slow(16.5, "node-c", dropped=False, own_s=0.25),
            slow(-3600.0, "node-x"), slow(14.0, own_s="fast"),
            {"time": 1013.0, "event": "node_dead", "node": "node-a", "peer": "node-d"}]


def test_stragglers_the_agents_named_join_the_summary_and_the_timeline() -> None:
    summary = with_agent_events(summarize(three_rounds()), [*agent_events(), slow(12.0)])
    assert [(s.node, s.time - 1000.0, s.dropped, s.by) for s in summary.stragglers] == [
        ("node-b", 12.0, True, "node-a"), ("node-c", 16.5, False, "node-a")]  # once each
    assert summary.stragglers[0].label == "node-b slow: own 0.300s vs 0.100s (3.0x), left out"
    assert summary.stragglers[1].label.endswith("(2.5x), kept")
    assert (summary.agent_events, summary.agent_events_ignored) == (7, 1)  # node-x: long ago
    marks = summary.marks()
    assert [m.kind for m in marks].count("slow") == 2
    first = next(m for m in marks if m.kind == "slow")
    assert (first.time, first.label) == (pytest.approx(1012.0), "node-b slow 3.0x, left out")
    assert summarize(three_rounds()).agent_events is None  # no events file given


def test_the_command_reads_agents_events_files_and_directories(tmp_path: Path) -> None:
    metrics = write(tmp_path / "m.jsonl", three_rounds())
    (tmp_path / "events").mkdir()
    write(tmp_path / "events" / "node-a.jsonl", agent_events())
    write(tmp_path / "events" / "node-b.jsonl", [slow(17.0, "node-a", dropped=False)])
    code, out, err = run_cli(str(metrics), "--events", str(tmp_path / "events"))
    assert code == report.EXIT_OK and not err
    assert ("stragglers: 3 (t=12.0s node-b slow: own 0.300s vs 0.100s (3.0x), left out; "
            "t=16.5s node-c slow: own 0.250s vs 0.100s (2.5x), kept; "
            "t=17.0s node-a slow: own 0.300s vs 0.100s (3.0x), kept)") in out.splitlines()
    assert "ignored: 1 straggler event(s) outside the run's time" in out
    code, out, _ = run_cli(str(metrics), "--json", "--events",
                           str(tmp_path / "events" / "node-b.jsonl"))
    data = json.loads(out)
    assert data["stragglers"] == [{"t": 17.0, "node": "node-a", "own_s": 0.3, "others_s": 0.1,
                                   "step_s": 0.3, "gain": 1.4, "dropped": False,
                                   "named_by": "node-a"}]
    assert (data["agent_events"], data["ignored_straggler_events"]) == (1, 0)
    assert "stragglers" not in run_cli(str(metrics))[1]  # nothing to say without the agents'
    code, out, err = run_cli(str(metrics), "--events", str(tmp_path / "nope.jsonl"))
    assert code == report.EXIT_BAD_INPUT and not out
    assert "nope.jsonl: no such file; give an agent's events file" in err


def test_the_timeline_draws_the_stragglers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = write(tmp_path / "m.jsonl", three_rounds())
    events = write(tmp_path / "a.jsonl", agent_events())
    code, _, err = run_cli(str(metrics), "--events", str(events), "--out", str(tmp_path / "rep"))
    assert code == report.EXIT_OK and not err
    assert (tmp_path / "rep" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- command
def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = report.run(parser.parse_args(argv), out, err)
    return code, out.getvalue(), err.getvalue()


def test_the_text_summary(tmp_path: Path) -> None:
    code, out, err = run_cli(str(write(tmp_path / "m.jsonl", three_rounds())))
    assert code == report.EXIT_OK and not err
    lines = out.splitlines()
    assert lines[0].endswith("m.jsonl: finished at step 80")
    assert "rounds: 3 (worker generations)" in lines
    assert "snapshot at step 40" in lines[3] and "cut short (a fault)" in lines[2]
    assert "stopped at step 60 by SIGTERM" in lines[3] and lines[4].endswith("done")
    assert "restores by source: fresh 1, snapshot 2" in lines
    assert "faults: 1 (round 1 cut at step 47)" in lines
    assert "steps trained twice: 7 (redone after a restore)" in lines
    assert "time not training: 9.5s (start-up 2.0s, gaps between rounds 4.4s + 3.1s)" in lines
    assert "total run time: 18.5s" in lines


def test_json_and_out_write_both_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = write(tmp_path / "m.jsonl", three_rounds())
    code, out, err = run_cli(str(metrics), "--json", "--out", str(tmp_path / "rep"))
    assert code == report.EXIT_OK
    data = json.loads(out)  # standard output is the JSON alone
    assert data["restores_by_source"] == {"fresh": 1, "snapshot": 2}
    assert data["steps_redone"] == 7 and data["total_s"] == pytest.approx(18.5)
    assert [r["restore"]["step"] for r in data["rounds"]] == [0, 40, 60]
    assert data["rounds"][1]["t"] == pytest.approx(10.0)
    assert data["faults"] == [{"t": pytest.approx(6.6), "description": "round 1 cut at step 47"}]
    assert "report.png" in err
    assert json.loads((tmp_path / "rep" / "report.json").read_text()) == data
    assert (tmp_path / "rep" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_summary_prints_and_out_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    metrics = write(tmp_path / "m.jsonl", three_rounds())
    code, out, err = run_cli(str(metrics), "--out", str(tmp_path / "rep"))
    assert code == report.EXIT_NO_PICTURE and not err
    assert "steps trained twice: 7" in out
    assert out.splitlines()[-1].endswith("pip install 'elastic-ext[report]'")
    assert (tmp_path / "rep" / "report.json").exists()
    assert not (tmp_path / "rep" / "report.png").exists()


@pytest.mark.parametrize("content, message", [
    (None, "no such file; give the file the run wrote with --metrics"),
    ("", "is empty"),
    ("hello\n", "line 1 is not JSON"),
    (json.dumps(ev("step", 1, 1.0)) + "\n", "has no 'start' event"),
    (b"\xff\xfe\x00", "is not a text file"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, content: str | bytes | None,
                                            message: str) -> None:
    path = tmp_path / "m.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, out, err = run_cli(str(path))
    assert code == report.EXIT_BAD_INPUT and not out
    assert err.startswith("elastic-ext report: ") and message in err
    assert err.count("\n") == 1


def test_a_directory_and_the_elastic_ext_entry_point(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", str(tmp_path)]) == report.EXIT_BAD_INPUT
    assert "is a directory; give the metrics file in it" in capsys.readouterr().err
    assert cli_main(["report", str(write(tmp_path / "m.jsonl", three_rounds()))]) == 0
    assert "rounds: 3" in capsys.readouterr().out


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path: Path) -> None:
    """``elastic-ext report FILE | head``: the reader is gone before the first write."""
    metrics = write(tmp_path / "m.jsonl", three_rounds())
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as after head has read its lines
    try:
        done = subprocess.run([sys.executable, "-m", "elastic_ext.ops.cli", "report", str(metrics)],
                              stdout=write_end, stderr=subprocess.PIPE, timeout=30, check=False)
    finally:
        os.close(write_end)
    assert done.stderr == b""
    assert done.returncode == 128 + signal.SIGPIPE


# ---------------------------------------------------------------------------- a real run
@pytest.mark.timeout(150)
def test_a_real_run_killed_and_resumed(processes: ProcessSet, tmp_path: Path) -> None:
    """The bundled trainer, SIGKILLed after a snapshot and run again to the end: two rounds."""
    snaps, metrics = tmp_path / "snaps", tmp_path / "m.jsonl"
    args = [*BASE_ARGS, "--snapshot-dir", str(snaps), "--snapshot-every", "5",
            "--metrics", str(metrics)]
    first = processes.spawn("first", trainer_cmd(*args, "--step-delay", "0.1"), env=env())
    snap = wait_event(metrics, lambda e: e["event"] == "snapshot" and e["step"] >= 10,
                      timeout=60, proc=first, what="a snapshot at step 10 or later")
    wait_event(metrics, lambda e: e["event"] == "step" and e["step"] >= snap["step"] + 2,
               timeout=30, proc=first, what="two steps past the snapshot")  # to be redone
    first.kill()
    finish(first, timeout=10)
    run_to_end(processes, "second", trainer_cmd(*args), timeout=90)

    events, unreadable = report.read_events(metrics)
    summary = summarize(events)
    assert summary.rounds == 2 and not unreadable
    killed_at, resumed = summary.segments[0].last_step, summary.restores[1].step
    assert [r.source for r in summary.restores] == ["fresh", "snapshot"]
    assert resumed % 5 == 0 and 10 <= snap["step"] <= resumed <= killed_at
    assert killed_at >= snap["step"] + 2
    assert summary.steps_redone == killed_at - resumed
    assert len(summary.faults) == 1 and not summary.preemptions
    assert summary.finished and summary.final_step == 40 and len(of(events, "done")) == 1
    assert len(summary.gaps_s) == 1 and summary.gaps_s[0] > 0
    assert 0 < summary.not_training_s < summary.total_s

    code, out, err = run_cli(str(metrics), "--out", str(tmp_path / "rep"))
    assert code in (report.EXIT_OK, report.EXIT_NO_PICTURE), err
    assert f"steps trained twice: {killed_at - resumed} (redone after a restore)" in out
    assert f"snapshot at step {resumed}" in out
    assert (tmp_path / "rep" / "report.json").exists()
