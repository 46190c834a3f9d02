"""The trainer's progress output: the pure parts with an injected clock, and a real torchrun run.

The real run goes through torchrun's ``--tee``, so the workers' stdout is a file, as with
``--redirects`` or a SLURM output file: plain lines, each prefixed with its local rank.
Its workers also run as under an etcd-ext agent (a faked control directory), so it is
also the run of a peer's death that the survivor reports and holds through, which
``tests/test_trainer_preemption.py`` had as a job of its own (the same job: 2 workers,
``--max-restarts=1``, rank 1 SIGKILLed after a snapshot). Its 40 steps are the shared
reference's (``tests.support.trainer_runs.BASE_ARGS``), so it ends bit-exact with it.
"""

from __future__ import annotations

import io
import re
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet, signal_pids, wait_until
from tests.support.trainer_runs import (
    BASE_ARGS,
    env,
    exit_lines,
    finish,
    of,
    reference,
    run_to_end,
    torchrun_cmd,
    wait_event,
    worker_pids,
)
from trainer.cli import parse_settings
from trainer.progress import (
    Progress,
    RateWindow,
    Status,
    choose_style,
    eta_seconds,
    format_bar_stats,
    format_duration,
    format_line,
    format_rate,
    open_progress,
    tqdm_bar_factory,
)

# -- the pure parts


@pytest.mark.parametrize(("seconds", "text"), [
    (-1.0, "0.0s"), (0.0, "0.0s"), (2.14, "2.1s"), (9.94, "9.9s"), (10.0, "10s"), (59.9, "59s"),
    (60.0, "1m00s"), (102.0, "1m42s"), (3599.0, "59m59s"), (3600.0, "1h00m"),
    (11100.0, "3h05m"), (86400.0, "1d00h"), (187200.0, "2d04h"),
])
def test_durations_are_short_and_fixed_in_shape(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("value", "text"), [
    (0.0, "0"), (0.03125, "0.0312"), (18.54, "18.5"), (27.0, "27"), (99.94, "99.9"),
    (592.4, "592"), (12345.6, "12346"),
])
def test_rates_have_about_three_significant_digits(value: float, text: str) -> None:
    assert format_rate(value) == text


def test_eta_is_unknown_without_a_rate_and_zero_at_the_end() -> None:
    assert eta_seconds(10, 100, None) is None
    assert eta_seconds(10, 100, 0.0) is None
    assert eta_seconds(10, 100, 3.0) == 30.0
    assert eta_seconds(100, 100, None) == 0.0


def test_the_rate_window_follows_a_change_within_its_span() -> None:
    window = RateWindow(span_s=10.0)
    assert window.rate() is None
    window.add(0.0, 0)
    assert window.rate() is None  # one sample: no rate yet
    for t in range(1, 21):  # 10 steps/s for 20 s
        window.add(float(t), 10 * t)
    assert window.rate() == pytest.approx(10.0)
    for t in range(21, 32):  # then 2 steps/s: after one span only the new rate counts
        window.add(float(t), 200 + 2 * (t - 20))
    assert window.rate() == pytest.approx(2.0)
    assert len(window._samples) <= 12  # bounded by the span, not by the run's length


def test_the_rate_window_keeps_an_anchor_when_steps_are_slower_than_its_span() -> None:
    window = RateWindow(span_s=10.0)
    window.add(0.0, 0)
    window.add(60.0, 1)
    window.add(120.0, 2)
    assert window.rate() == pytest.approx(1 / 60)


BASE = Status(step=120, total=2000, loss=0.0123, steps_per_s=18.5, global_batch_size=32,
              world_size=2, restarts=0, snapshot_age_s=2.1)


def test_the_line_format_is_stable() -> None:
    """The documented format (docs/trainer.md, trainer/progress.py): tools grep it, keep it."""
    assert format_line(BASE) == (
        "progress: step 120/2000 (6.0%) loss 0.0123 | 18.5 steps/s 592 samples/s | world 2 | "
        "agent restarts 0 | snapshot 2.1s ago | ETA 1m41s")
    start = replace(BASE, loss=None, steps_per_s=None, snapshot_age_s=None, restarts=1,
                    event="resumed from step 120")
    assert format_line(start) == (
        "progress: step 120/2000 (6.0%) loss -- | -- steps/s -- samples/s | world 2 | "
        "agent restarts 1 | snapshot none yet | ETA -- | resumed from step 120")
    done = replace(BASE, step=2000, snapshots_on=False, event="done")
    assert format_line(done) == (
        "progress: step 2000/2000 (100.0%) loss 0.0123 | 18.5 steps/s 592 samples/s | "
        "world 2 | agent restarts 0 | snapshot off | ETA 0.0s | done")
    assert "(100.0%)" in format_line(replace(BASE, step=0, total=0))


def test_the_bar_shows_the_eta_and_rates_first() -> None:
    assert format_bar_stats(BASE) == ("ETA 1m41s | 18.5 steps/s 592 samples/s | loss 0.0123 | "
                                      "world 2 | agent restarts 0 | snapshot 2.1s ago")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class NoIsatty:
    def write(self, text: str) -> int:
        return len(text)


def test_a_bar_only_on_a_terminal_with_tqdm() -> None:
    assert choose_style(FakeTTY(), have_tqdm=True) == "bar"
    assert choose_style(FakeTTY(), have_tqdm=False) == "lines"
    assert choose_style(io.StringIO(), have_tqdm=True) == "lines"  # a file, a pipe, --tee
    assert choose_style(NoIsatty(), have_tqdm=True) == "lines"
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError
    assert choose_style(closed, have_tqdm=True) == "lines"


def test_without_tqdm_a_terminal_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    assert tqdm_bar_factory() is None
    out = FakeTTY()
    progress = open_progress(rank=0, every_s=10, total=100, global_batch_size=8, world_size=1,
                             restarts=0, snapshots_on=False, stream=out)
    assert progress.enabled and progress.style == "lines"
    progress.start(0, None, None)
    assert out.getvalue().startswith("progress: step 0/100 (0.0%)")


# -- Progress with an injected clock


@dataclass
class FakeClock:
    t: float = 1000.0
    calls: int = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.t


def _progress(clock: FakeClock, out: Any, **kw: Any) -> Progress:
    settings: dict[str, Any] = dict(total=100, global_batch_size=8, world_size=2, restarts=1,
                                    every_s=10.0, stream=out, clock=clock)
    settings.update(kw)
    return Progress(**settings)


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_lines_at_the_start_every_interval_and_at_the_end() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = _progress(clock, out)
    progress.start(40, 40, snapshot_age_s=3.0)
    assert _lines(out) == [
        "progress: step 40/100 (40.0%) loss -- | -- steps/s -- samples/s | world 2 | "
        "agent restarts 1 | snapshot 3.0s ago | ETA -- | resumed from step 40"]
    clock.t += 5.0  # a slow start-up (DDP, the first collective) must not count in the rate
    calls = clock.calls
    for step in range(41, 60):  # 4 steps/s for 4.75 s: no line before the interval
        progress.step(step, loss=0.5)
        clock.t += 0.25
    assert len(_lines(out)) == 1
    assert clock.calls - calls == 19  # one clock read per step, nothing else
    progress.snapshot_durable()
    for step in range(60, 65):
        progress.step(step, loss=0.25)
        clock.t += 0.25
    lines = _lines(out)
    assert len(lines) == 2
    assert lines[1] == ("progress: step 61/100 (61.0%) loss 0.25 | 4 steps/s 32 samples/s | "
                        "world 2 | agent restarts 1 | snapshot 0.2s ago | ETA 9.8s")
    clock.t += 60.0  # a long stall: one line when it ends, not a burst of missed ones
    progress.step(65, loss=0.125)
    progress.step(66, loss=0.125)
    assert len(_lines(out)) == 3
    progress.finish("done")
    assert _lines(out)[-1] == (
        "progress: step 66/100 (66.0%) loss 0.125 | 0.082 steps/s 0.656 samples/s | world 2 | "
        "agent restarts 1 | snapshot 1m01s ago | ETA 6m54s | done")
    progress.step(67, loss=0.1)
    clock.t += 100.0
    progress.step(68, loss=0.1)
    assert len(_lines(out)) == 4  # nothing after the end


def test_progress_off_prints_nothing_and_reads_no_clock() -> None:
    for rank, every in [(1, 10.0), (0, 0.0)]:
        out = FakeTTY()
        progress = open_progress(rank=rank, every_s=every, total=10, global_batch_size=2,
                                 world_size=2, restarts=0, snapshots_on=True, stream=out)
        assert not progress.enabled
        progress.start(0, None, None)
        for step in range(1, 11):
            progress.step(step, loss=1.0)
        progress.snapshot_durable()
        progress.finish("done")
        progress.close()
        assert out.getvalue() == ""
    clock = FakeClock()
    off = _progress(clock, io.StringIO(), every_s=0)
    off.start(0, None, None)
    off.step(1, 1.0)
    assert clock.calls == 0


class BrokenPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_failing_stream_turns_progress_off_not_training(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    clock = FakeClock()
    progress = _progress(clock, BrokenPipe())
    progress.start(0, None, None)
    assert not progress.enabled
    assert "progress output off" in caplog.text
    clock.t += 100
    progress.step(1, 1.0)
    progress.finish("done")


@dataclass
class FakeBar:
    total: int
    n: float
    stream: Any
    refreshes: int = 0
    desc: str = ""
    closed: bool = False

    def set_description_str(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc

    def refresh(self) -> None:
        self.refreshes += 1

    def write(self, s: str, file: Any = None) -> None:
        (file or self.stream).write(s + "\n")

    def close(self) -> None:
        self.closed = True


def test_on_a_terminal_the_bar_replaces_the_periodic_lines() -> None:
    clock, out, bars = FakeClock(), FakeTTY(), []

    def factory(total: int, initial: int, stream: Any) -> FakeBar:
        bars.append(FakeBar(total, initial, stream))
        return bars[-1]

    progress = _progress(clock, out, style="bar", bar_factory=factory, every_s=10.0)
    progress.start(0, None, None)
    assert [(b.total, b.n) for b in bars] == [(100, 0)]
    assert _lines(out)[0].endswith("| started")
    for step in range(1, 81):  # 20 s at 4 steps/s: refreshed every second, no lines
        progress.step(step, loss=0.5)
        clock.t += 0.25
    bar = bars[0]
    assert len(_lines(out)) == 1
    assert 19 <= bar.refreshes <= 21 and bar.n == 77
    assert bar.desc.startswith("ETA 5.8s | 4 steps/s 32 samples/s | loss 0.5 | world 2")
    progress.finish("done")
    assert bar.closed and bar.n == 80
    assert _lines(out)[-1].startswith("progress: step 80/100 (80.0%)")
    assert _lines(out)[-1].endswith("| done")


def test_a_real_tqdm_bar_on_a_fake_terminal() -> None:
    """tqdm draws on a terminal that reports no size (no fileno here) too."""
    out = FakeTTY()
    progress = open_progress(rank=0, every_s=0.01, total=50, global_batch_size=4, world_size=1,
                             restarts=0, snapshots_on=True, stream=out)
    assert progress.style == "bar"
    progress.start(0, None, None)
    for step in range(1, 51):
        progress.step(step, loss=0.5)
    progress.finish("done")
    text = out.getvalue()
    assert text.startswith("progress: step 0/50 (0.0%) loss --")
    assert "50/50 100%|" in text and "| ETA 0.0s |" in text
    assert text.endswith("| done\n")


def test_the_flag() -> None:
    assert parse_settings([])[0].progress_every == 10.0
    assert parse_settings(["--progress-every", "0"])[0].progress_every == 0.0
    assert parse_settings(["--progress-every", "2.5"])[0].progress_every == 2.5
    for bad in ["-1", "nan", "inf"]:
        with pytest.raises(SystemExit):
            parse_settings(["--progress-every", bad])


# -- a real run under torchrun

LINE = re.compile(
    r"progress: step (?P<step>\d+)/(?P<total>\d+) \((?P<pct>[\d.]+)%\) loss (?P<loss>\S+) \| "
    r"(?P<rate>\S+) steps/s (?P<samples>\S+) samples/s \| world (?P<world>\d+) \| "
    r"agent restarts (?P<restarts>\d+) \| snapshot (?P<snapshot>none yet|off|\S+ ago) \| "
    r"ETA (?P<eta>\S+)(?: \| (?P<event>.+))?$")
ARGS = (*BASE_ARGS, "--snapshot-every", "5", "--progress-every", "0.5")  # 40 steps


def _progress_lines(output: str) -> list[dict[str, str]]:
    """Every progress line of the agent's output, checked to come from local rank 0 (the
    only node: global rank 0) and to match the documented format."""
    found = re.findall(r"^\[default(\d+)\]:(progress: .*)$", output, flags=re.M)
    assert found and len(found) == output.count("progress: "), output[-4000:]
    assert {rank for rank, _ in found} == {"0"}
    parsed = []
    for _, line in found:
        match = LINE.fullmatch(line)
        assert match, line
        parsed.append(match.groupdict())
    return parsed


def _generations(lines: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    gens: list[list[dict[str, str]]] = []
    for line in lines:
        event = line["event"] or ""
        if event == "started" or event.startswith("resumed from step "):
            gens.append([])
        assert gens, "the first line must start a generation"
        gens[-1].append(line)
    return gens


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_progress_lines_of_a_real_run_with_a_restart_and_a_world_size_change(
        processes: ProcessSet, tmp_path: Path) -> None:
    """2 workers; rank 1 is killed after a snapshot and the agent restarts both (restart
    1); then the same job on 1 worker.

    The workers run as under an etcd-ext agent (its control directory, here faked), so
    this is also the run of a peer's death that a survivor reports: it does not fail but
    holds until its agent stops it. The stock agent here restarts the group on rank 1's
    death; it SIGTERMs the holding rank 0, which must leave at once so that the restart
    does not wait 30 s for it. The run ends bit-exact with an uninterrupted one.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's default, the c10d rendezvous
    shares its TCPStore with the workers and the restarted gloo group reads a dead
    worker's address from the previous round ("Gloo connectFullMesh failed ...
    Connection refused"), with or without this package (pytorch issue 135712).
    """
    ref = reference(processes, tmp_path, 2)
    snaps, metrics = tmp_path / "snaps", tmp_path / "m.jsonl"
    args = [*ARGS, "--snapshot-dir", str(snaps), "--metrics", str(metrics)]
    tee = ("--tee=3", f"--log-dir={tmp_path / 'torchrun-logs'}")
    control = tmp_path / "control"
    control.mkdir()
    (control / "round").write_text("0")

    # 40 steps at 0.1 s: 3 s and more of training after the restart
    agent = processes.spawn(
        "two", torchrun_cmd(2, *args, "--step-delay", "0.1",
                            agent_args=("--max-restarts=1", "--monitor-interval=3", *tee)),
        env=env(ELASTIC_EXT_CONTROL_DIR=str(control), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    wait_event(metrics, lambda e: e["event"] == "snapshot" and e["step"] >= 10, 60, agent,
               "snapshot 10")
    workers = worker_pids(agent, 2)
    killed_at = time.time()
    signal_pids([workers[1]], signal.SIGKILL)
    fault = wait_until(lambda: (control / "fault-0").exists() and (control / "fault-0").read_text(),
                       timeout=15, what="a fault report")
    assert isinstance(fault, str) and fault.startswith("rank 0: RuntimeError") and "gloo" in fault
    restarted = wait_event(metrics, lambda e: e["event"] == "start" and e["restart"] == 1, 60,
                           agent, "the restart")
    # The agent launched the new workers within its monitor interval and a moment: a held
    # worker would add 30 s. Measured to their launch, not to their first step, which adds
    # the new workers' import of torch (seconds; 19 s once with two tests on 2 cores).
    assert restarted["launched_at"] - killed_at < 10, (restarted, killed_at)
    assert finish(agent, 120) == 0, agent.output()[-6000:]
    log = agent.output()
    assert "reported to the etcd-ext agent" in log
    assert (0, 128 + signal.SIGTERM) in exit_lines(agent)  # stopped by its agent, promptly
    assert of(read_json_lines(metrics), "done")[-1]["params_sha256"] == ref.sha256
    resumed = of(read_json_lines(metrics), "start")[-1]
    assert resumed["restart"] == 1 and resumed["resumed_from"] >= 10

    first, second = _generations(_progress_lines(log))
    assert first[0]["event"] == "started" and first[0]["step"] == "0"
    assert first[0]["snapshot"] == "none yet" and first[0]["rate"] == "--"
    assert {(line["world"], line["restarts"]) for line in first} == {("2", "0")}
    assert second[0]["event"] == f"resumed from step {resumed['resumed_from']}"
    assert second[0]["step"] == str(resumed["resumed_from"])
    assert second[0]["snapshot"].endswith(" ago")
    assert {(line["world"], line["restarts"]) for line in second} == {("2", "1")}
    for gen in (first, second):
        steps = [int(line["step"]) for line in gen]
        assert steps == sorted(steps) and all(line["total"] == "40" for line in gen)
    periodic = [line for line in second if not line["event"] and line["rate"] != "--"]
    assert len(periodic) >= 2, second  # 3 s and more of training at a 0.5 s interval
    for line in periodic:
        rate, samples = float(line["rate"]), float(line["samples"])
        assert samples == pytest.approx(14 * rate, rel=0.02, abs=1)
        float(line["loss"])
    last = second[-1]
    assert (last["event"], last["step"], last["pct"], last["eta"]) == ("done", "40", "100.0",
                                                                       "0.0s")

    # The same job on 1 worker: it resumes from the end of the last one, at world size 1.
    one = run_to_end(processes, "one", torchrun_cmd(1, *args, "--steps", "60",
                                                    agent_args=tee), timeout=90)
    (gen,) = _generations(_progress_lines(one.output()))
    assert gen[0]["event"] == "resumed from step 40"
    assert {(line["world"], line["restarts"]) for line in gen} == {("1", "0")}
    assert (gen[-1]["event"], gen[-1]["step"]) == ("done", "60")
