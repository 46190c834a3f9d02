"""``elastic-ext``: operator commands (status, list, report, doctor) and the chaos harness."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "status": ("elastic_ext.ops.status",
               "show a run's round, members, restarts and newest snapshot"),
    "list": ("elastic_ext.ops.status", "list the run ids under the key prefix"),
    "report": ("elastic_ext.ops.report",
               "summarize a run from its metrics file: rounds, restores, steps trained twice, "
               "time not training; draw its timeline"),
    "doctor": ("elastic_ext.ops.doctor",
               "a preflight on every node: etcd, the run id, the peers on the workers' "
               "network, GPUs, clocks, the snapshot directory; takes the job's torchrun line"),
    "chaos": ("elastic_ext.chaos.cli",
              "run a local job under a fault scenario and check invariants"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not exc.name or not module_name.startswith(exc.name):
                raise
            continue
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser, name)
        sub_parser.set_defaults(_run=module.run)
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "_accepts_rest", False):
        parser.error("unrecognized arguments: " + " ".join(rest))
    args._rest = rest  # ``doctor`` takes a whole torchrun line and ignores what is not its
    try:
        code = int(args._run(args))
        sys.stdout.flush()  # a pipe closed early shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """``elastic-ext report FILE | head``: the reader closed the pipe, which is not an
    error of ours. Standard output goes to /dev/null so that the interpreter's final
    flush fails silently too; the status is the one a process killed by SIGPIPE has."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
