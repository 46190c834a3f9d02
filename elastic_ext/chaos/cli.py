"""``elastic-ext chaos``: run scenarios against a local job, print what broke, write a report.

``elastic-ext chaos soak --duration D --seed S`` plays a random schedule of faults
(:mod:`elastic_ext.chaos.soak`) through the same runner; ``soak`` is a word of the
command, not a scenario name (a scenario file called ``soak`` is ``./soak``).

The only module of the harness that writes to the terminal: results go to the
``out`` stream (standard output), the harness's own log to standard error when
``--verbose`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from elastic_ext.chaos import matrix, netns, soak
from elastic_ext.chaos.report import summaries, write_report, write_soak_report
from elastic_ext.chaos.runner import RunOptions, RunResult, run_scenario
from elastic_ext.chaos.scenario import Scenario, ScenarioError, parse, settings_help

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2

EPILOG = """\
A SCENARIO is a built-in name, a group (ci: the fast subset, full: the whole matrix),
a scenario file, or - to read one from standard input. Scenario format:

  nodes = 3                       # settings first: key = value
  at step 30: kill node other     # then faults: TRIGGER: ACTION, fired in order
  when recovered: start node
  at step 100: preempt all
  when stopped: start all

Triggers: at step N | after Ds | when world N | when recovered | when stopped.
Actions: kill worker T | kill node T | freeze node T for Ds | partition node T for Ds |
cut peers of node T for Ds | slow node T [to F] [every Pms] [for Ds] (a straggler: its
workers run F of every P, default 1/3 of 30ms) | preempt all|agents | start node |
start N nodes | start all | kill etcd leader|follower|all [for Ds] | fill disk [for Ds].
T: a node index, rank0, other or all.

Soak: elastic-ext chaos soak --duration 30m --seed S [--every 20-40s] [--nodes 3]
[--kinds KIND,...] [--recovery-bound 2m] [--print-schedule] plays a random schedule of
faults, the same for the same seed, and checks the invariants plus a recovery bound;
--print-schedule prints it as a scenario file instead (replay: elastic-ext chaos FILE).
Kinds: {kinds}.

Exit status: 0 every scenario passed (or was skipped, with the reason printed),
1 an invariant broke, 2 a scenario could not be read.
""".format(kinds=", ".join(soak.KINDS))


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastic-ext" / "chaos"


def add_arguments(parser: argparse.ArgumentParser, name: str = "chaos") -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG + "\nSettings:\n" + "\n".join(
        f"  {key:<18} default {default:<8} {text}" for key, default, text in settings_help())
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help="built-in name, ci, full, a scenario file, or -")
    parser.add_argument("--list", action="store_true",
                        help="list the built-in scenarios and groups")
    parser.add_argument("--show", metavar="NAME",
                        help="print a built-in scenario, to copy and edit")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of every scenario run (repeatable)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="write NAME.json and NAME.png (timeline) per scenario, and index.json")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="where the jobs run "
                             "(default: a temporary directory, removed after a pass)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directories after a pass too")
    parser.add_argument("--module", default="trainer",
                        help="training module run by torchrun -m, or a script (PATH.py, e.g. "
                             "examples/own_loop.py); it must accept the trainer's flags and "
                             "write its metrics file (default: the bundled trainer)")
    parser.add_argument("--trainer-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the training module (repeatable)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the uninterrupted run that the final parameters are "
                             "compared with")
    parser.add_argument("--reference-cache", type=Path, default=default_cache(), metavar="DIR",
                        help="where uninterrupted runs' results are kept (default %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the harness's actions to stderr")
    group = parser.add_argument_group("soak", "elastic-ext chaos soak --duration D [--seed S] "
                                              "...: a random schedule of faults")
    group.add_argument("--duration", metavar="TIME",
                       help="how long the soak runs, e.g. 2m, 30m, 1h (required)")
    group.add_argument("--seed", metavar="N",
                       help="the schedule's seed: the same seed plays the same faults "
                            "(default: a random one, printed)")
    group.add_argument("--every", metavar="RANGE",
                       help="gap between two faults, drawn uniformly (default 20-40s)")
    group.add_argument("--nodes", metavar="N",
                       help="nodes the job starts with and returns to after each fault "
                            "(default 3)")
    group.add_argument("--kinds", metavar="KIND,...",
                       help="fault kinds to draw from (default all but cut-peers, which "
                            "`all` adds; partition only where network namespaces can be made)")
    group.add_argument("--recovery-bound", metavar="TIME",
                       help="longest a fault may take to recover, and training may stand "
                            "still (default 2m)")
    group.add_argument("--print-schedule", action="store_true",
                       help="print the schedule as a scenario file and exit")


def _load(selector: str, overrides: dict[str, str], stdin: TextIO) -> list[Scenario]:
    try:
        names = matrix.names(selector)
    except KeyError:
        names = ()
    if names:
        scenarios = [matrix.scenario(name) for name in names]
    elif selector == "-":
        scenarios = [parse(stdin.read(), "stdin")]
    else:
        path = Path(selector)
        if not path.is_file():
            raise ScenarioError(f"{selector!r} is neither a built-in scenario "
                                f"({', '.join(matrix.SCENARIOS)}, "
                                f"or a group: {', '.join(matrix.GROUPS)}) nor a file")
        scenarios = [parse(path.read_text(), path.stem)]
    return [s.with_settings(overrides) for s in scenarios]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _overrides(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ScenarioError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _one_line(result: RunResult) -> str:
    took = f"{result.ended - result.started:.1f}s"
    if result.skipped:
        return f"SKIP {result.scenario.name}: {result.skipped}"
    verdict = result.verdict
    assert verdict is not None and result.observation is not None
    faults = [f for f in result.observation.faults if not f.restore]
    facts = (f"{len(faults)} fault(s), {len(verdict.restarts)} restart(s), "
             f"lost {verdict.lost_steps} step(s), params {verdict.params_check}")
    return f"{'PASS' if verdict.ok else 'FAIL'} {result.scenario.name} in {took}: {facts}"


SOAK_OPTIONS = ("duration", "seed", "every", "nodes", "kinds", "recovery_bound", "print_schedule")


def run(args: argparse.Namespace, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    out = out or sys.stdout
    stdin = stdin or sys.stdin
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.scenarios[:1] == ["soak"]:
        return run_soak_command(args, out)
    given = [name for name in SOAK_OPTIONS if getattr(args, name, None)]
    if given:
        out.write(f"error: --{given[0].replace('_', '-')} is an option of the soak: "
                  "elastic-ext chaos soak --duration D ...\n")
        return EXIT_USAGE
    if args.list:
        for name in matrix.SCENARIOS:
            first = matrix.text(name).splitlines()[0].lstrip("# ")
            out.write(f"{name:<14} {first}\n")
        for group, members in matrix.GROUPS.items():
            out.write(f"{group:<14} group: {' '.join(members)}\n")
        out.write(f"{'soak':<14} a random schedule of faults: elastic-ext chaos soak "
                  "--duration 30m --seed S\n")
        return EXIT_OK
    if args.show:
        if args.show not in matrix.SCENARIOS:
            out.write(f"no built-in scenario {args.show!r}; "
                      f"built in: {', '.join(matrix.SCENARIOS)}\n")
            return EXIT_USAGE
        out.write(matrix.text(args.show))
        return EXIT_OK
    if not args.scenarios:
        out.write("name a scenario (elastic-ext chaos --list shows the built-in ones)\n")
        return EXIT_USAGE
    try:
        overrides = _overrides(args.set)
        scenarios = [s for selector in args.scenarios for s in _load(selector, overrides, stdin)]
    except ScenarioError as exc:
        out.write(f"error: {exc}\n")
        return EXIT_USAGE

    # SIGTERM (a CI timeout, `timeout`, an operator) unwinds like Ctrl-C: the runner's
    # finally blocks then kill the job and remove namespaces and mounts.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-ext-chaos-"))
    results: list[RunResult] = []
    for index, scenario in enumerate(scenarios):
        workdir = base / f"{index:02d}-{scenario.name}"
        if workdir.exists():
            shutil.rmtree(workdir)
        out.write(f"running {scenario.name} ({len(scenario.faults)} fault(s), "
                  f"{scenario.settings.nodes} node(s), {scenario.settings.store})...\n")
        out.flush()
        options = RunOptions(workdir=workdir, module=args.module,
                             trainer_extra=tuple(args.trainer_arg),
                             reference=not args.no_reference, reference_cache=args.reference_cache)
        result = run_scenario(scenario, options)
        results.append(result)
        out.write(_one_line(result) + "\n")
        if result.verdict is not None:
            for violation in result.verdict.violations:
                out.write(f"  - {violation}\n")
        if args.report is not None:
            written = write_report(result, args.report)
            out.write("  report: " + ", ".join(str(p) for p in written.values()) + "\n")
        if result.ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not result.ok:
            out.write(f"  logs: {workdir / 'logs'}\n")
        out.flush()
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "index.json").write_text(json.dumps(summaries(results), indent=2) + "\n")
    broken = [r for r in results if not r.ok]
    if args.workdir is None and not broken and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    skipped = sum(1 for r in results if r.skipped)
    out.write(f"chaos: {len(results) - len(broken) - skipped} passed, {len(broken)} failed"
              + (f", {skipped} skipped" if skipped else "") + "\n")
    return EXIT_BROKEN if broken else EXIT_OK


# ---------------------------------------------------------------------------------- soak
def _soak_plan(args: argparse.Namespace, out: TextIO) -> soak.Soak:
    """The soak the options ask for; :class:`ScenarioError` names the option to fix."""
    if len(args.scenarios) > 1:
        raise soak.ScheduleError(f"soak takes no scenario ({' '.join(args.scenarios[1:])}); "
                                 "a scenario file called soak is ./soak")
    if args.list or args.show:
        raise soak.ScheduleError("--list and --show are not options of the soak")
    if not args.duration:
        raise soak.ScheduleError("soak needs --duration, e.g. --duration 30m")
    duration = soak.parse_duration(args.duration)
    every = soak.parse_every(args.every or "20-40s")
    bound = soak.parse_duration(args.recovery_bound or "2m", "--recovery-bound")
    try:
        nodes = int(args.nodes or 3)
    except ValueError:
        raise soak.ScheduleError(f"--nodes {args.nodes!r}: expected a number of nodes, "
                                 "e.g. 3") from None
    if args.seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    else:
        try:
            seed = int(args.seed)
        except ValueError:
            raise soak.ScheduleError(f"--seed {args.seed!r}: expected a whole number, "
                                     "e.g. 7") from None
    if args.kinds:
        kinds = soak.parse_kinds(args.kinds)
    else:
        kinds = soak.DEFAULT_KINDS
        reason = None if args.print_schedule else netns.unavailable()
        if reason is not None:
            kinds = tuple(k for k in kinds if k not in soak.NETNS_KINDS)
            out.write(f"note: partition left out: {reason}\n")
    return soak.plan(seed, duration, every=every, nodes=nodes, kinds=kinds,
                     overrides=_overrides(args.set), recovery_bound_s=bound)


def _soak_line(result: soak.SoakResult) -> str:
    """Like :func:`_one_line`, counting the soak's faults rather than the scenario's lines."""
    run = result.run
    if run.skipped or run.verdict is None:
        return _one_line(run)
    verdict = run.verdict
    return (f"{'PASS' if result.ok else 'FAIL'} {run.scenario.name} in "
            f"{run.ended - run.started:.1f}s: {result.stats.fired} fault(s), "
            f"{len(verdict.restarts)} new round(s), lost {verdict.lost_steps} step(s), "
            f"params {verdict.params_check}")


def run_soak_command(args: argparse.Namespace, out: TextIO) -> int:
    """``elastic-ext chaos soak``: plan, play, judge and report one random-fault soak."""
    try:
        plan = _soak_plan(args, out)
    except ScenarioError as exc:
        out.write(f"error: {exc}\n")
        return EXIT_USAGE
    if args.print_schedule:
        out.write(plan.text)
        return EXIT_OK
    needs_netns = [kind for kind in plan.kinds if kind in soak.NETNS_KINDS]
    if needs_netns:
        reason = netns.unavailable()
        if reason is not None:
            out.write(f"error: --kinds {','.join(needs_netns)} needs network namespaces "
                      f"({reason}); leave {' and '.join(needs_netns)} out\n")
            return EXIT_USAGE
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    scenario = plan.scenario
    settings = scenario.settings
    base = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-ext-soak-"))
    workdir = base / scenario.name
    if workdir.exists():
        shutil.rmtree(workdir)
    out.write(f"running {scenario.name}: {len(plan.faults)} fault(s) over about "
              f"{soak.format_duration(round(plan.planned_s))} (every "
              f"{soak.format_every(plan.every)}), {settings.nodes} node(s), {settings.store}, "
              f"{scenario.network}...\n")
    out.flush()
    options = RunOptions(workdir=workdir, module=args.module,
                         trainer_extra=tuple(args.trainer_arg),
                         reference=not args.no_reference, reference_cache=args.reference_cache)
    result = soak.run_soak(plan, options)
    out.write(_soak_line(result) + "\n")
    for violation in result.all_violations:
        out.write(f"  - {violation}\n")
    for line in soak.fault_lines(result):
        out.write(f"  {line}\n")
    for line in soak.summary_lines(result):
        out.write(f"{line}\n")
    if args.report is not None and not result.skipped:
        written = write_soak_report(result, args.report)
        out.write("report: " + ", ".join(str(p) for p in written.values()) + "\n")
    if result.ok and not args.keep:
        shutil.rmtree(workdir if args.workdir is not None else base, ignore_errors=True)
    elif not result.ok:
        out.write(f"logs: {workdir / 'logs'}\n")
    out.flush()
    return EXIT_OK if result.ok else EXIT_BROKEN


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_ext.chaos``: the same command without the ``elastic-ext`` wrapper."""
    parser = argparse.ArgumentParser(prog="elastic-ext chaos",
                                     description="run a local job under a fault scenario and "
                                                 "check invariants")
    add_arguments(parser)
    return run(parser.parse_args(argv))
