"""``elastic-ext``: operator commands (status, list, report) and the chaos harness (chaos)."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "status": ("elastic_ext.ops", "show a run's round, members, restarts and newest snapshot"),
    "list": ("elastic_ext.ops", "list the run ids under the key prefix"),
    "report": ("elastic_ext.report",
               "summarize a run from its metrics file: rounds, restores, steps trained twice, "
               "time not training; draw its timeline"),
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
    args = parser.parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
