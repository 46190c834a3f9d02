"""``LoopSettings``: the renamed fields' old keyword names, and timeouts checked against
each other at construction (pure: nothing starts)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from elastic_ext.worker.loop import LoopSettings
from trainer.train import Trainer, TrainSettings

TIMEOUTS = ("collective_timeout_s", "stop_grace_s", "preempt_grace_s", "hold_timeout_s")


def test_the_fields_say_what_they_are() -> None:
    names = [f.name for f in dataclasses.fields(LoopSettings)]
    assert names == ["snapshot_dir", "snapshot_every", "keep_snapshots", "total_steps",
                     "device", "collective_backend", "collective_timeout_s", "stop_grace_s",
                     "preempt_grace_s", "hold_timeout_s", "events_file", "shard_copy_every",
                     "shard_copy_in_background", "resume_other_runs"]


@pytest.mark.parametrize(("field", "value"), [
    ("snapshot_every", -1), ("shard_copy_every", -1), ("keep_snapshots", 0),
    ("shard_copy_every", 1.5), ("snapshot_every", True)])
def test_a_count_that_cannot_be_honoured_is_refused_naming_the_field(
        field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"LoopSettings.{field}={value!r} must be a whole "
                                         "number, at least"):
        LoopSettings(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("old", "new", "value"), [
    ("metrics", "events_file", Path("events.jsonl")),
    ("backend", "collective_backend", "gloo"),
    ("keep", "keep_snapshots", 5),
])
def test_an_old_keyword_still_works_with_a_warning_naming_the_new_one(
        old: str, new: str, value: object) -> None:
    with pytest.warns(DeprecationWarning, match=f"LoopSettings\\({old}=...\\) is deprecated: "
                                                f"use {new}=") as caught:
        settings = LoopSettings(**{old: value})  # type: ignore[arg-type]
    assert getattr(settings, new) == value
    assert settings == LoopSettings(**{new: value})  # type: ignore[arg-type]
    assert caught[0].filename == __file__  # points at the caller's line


def test_an_old_keyword_given_as_none_still_warns() -> None:
    with pytest.warns(DeprecationWarning, match="use events_file="):
        assert LoopSettings(metrics=None).events_file is None  # type: ignore[call-arg]


def test_the_new_names_do_not_warn_and_replace_keeps_them() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = LoopSettings(events_file=Path("e"), collective_backend="gloo",
                                keep_snapshots=2)
        again = dataclasses.replace(settings, snapshot_every=4)
    assert (again.events_file, again.collective_backend, again.keep_snapshots,
            again.snapshot_every) == (Path("e"), "gloo", 2, 4)


def test_a_field_under_both_names_is_refused_even_when_the_new_one_is_its_default() -> None:
    with pytest.raises(TypeError, match="both keep= and keep_snapshots=: give keep_snapshots"):
        LoopSettings(keep=5, keep_snapshots=3)  # type: ignore[call-arg]


def test_an_old_name_read_gives_the_new_fields_value_with_a_warning() -> None:
    settings = LoopSettings(events_file=Path("events.jsonl"), collective_backend="gloo",
                            keep_snapshots=5)
    for old, value in (("metrics", Path("events.jsonl")), ("backend", "gloo"), ("keep", 5)):
        with pytest.warns(DeprecationWarning, match=f"LoopSettings.{old} is deprecated: read"):
            assert getattr(settings, old) == value
    assert dataclasses.replace(settings, keep_snapshots=2).keep_snapshots == 2


def test_a_field_under_both_names_is_refused_naming_both() -> None:
    with pytest.raises(TypeError, match="both metrics= and events_file=: give events_file"):
        LoopSettings(events_file=Path("a"), metrics=Path("b"))  # type: ignore[call-arg]


@pytest.mark.parametrize("name", TIMEOUTS)
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_a_timeout_that_is_not_a_positive_number_is_refused_naming_it(
        name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"LoopSettings.{name}=.* must be a positive number "
                                         "of seconds"):
        LoopSettings(**{name: value})  # type: ignore[arg-type]


def test_a_stop_grace_longer_than_the_preemption_grace_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="stop_grace_s=40 is longer than preempt_grace_s=30: "
                                         ".*raise preempt_grace_s to at least 40 or lower "
                                         "stop_grace_s"):
        LoopSettings(stop_grace_s=40, preempt_grace_s=30)
    assert LoopSettings(stop_grace_s=30, preempt_grace_s=30).stop_grace_s == 30  # equal: fine


def test_the_defaults_and_the_trainer_defaults_pass() -> None:
    LoopSettings()
    s = TrainSettings()
    LoopSettings(collective_timeout_s=s.collective_timeout, stop_grace_s=s.stop_grace,
                 preempt_grace_s=s.preempt_grace, hold_timeout_s=s.hold_timeout)


def test_the_trainer_refuses_such_flags_before_it_starts_anything() -> None:
    """``--stop-grace 40 --preempt-grace 30``: the trainer's ``trainer: ...`` exit, before
    the guard or the process group exist."""
    with pytest.raises(SystemExit, match="trainer: LoopSettings.stop_grace_s=40 is longer"):
        Trainer(TrainSettings(stop_grace=40, preempt_grace=30))
    with pytest.raises(SystemExit, match="trainer: LoopSettings.hold_timeout_s=0 must be"):
        Trainer(TrainSettings(hold_timeout=0))


def test_paths_given_as_text_are_taken_and_other_types_are_refused() -> None:
    settings = LoopSettings(events_file="run/events.jsonl",  # type: ignore[arg-type]
                            snapshot_dir="run/snapshots")  # type: ignore[arg-type]
    assert settings.events_file == Path("run/events.jsonl")
    assert settings.snapshot_dir == Path("run/snapshots")
    with pytest.raises(TypeError, match=r"LoopSettings.events_file=3 must be a path"):
        LoopSettings(events_file=3)  # type: ignore[arg-type]
