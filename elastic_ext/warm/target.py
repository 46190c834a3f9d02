"""What a worker runs: ``-m MODULE`` or a script path, parsed like ``python`` does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

USAGE = ("usage: python -m elastic_ext.warm (-m MODULE | SCRIPT) [ARGS...]\n"
         "  e.g. torchrun --rdzv-backend=etcd-ext ... -m elastic_ext.warm -m mytrainer --lr 0.1")


class UsageError(Exception):
    """The launcher's command line names no module or script; the message says how."""


@dataclass(frozen=True)
class Target:
    kind: str  # "module" or "path"
    name: str

    @classmethod
    def module(cls, name: str) -> Target:
        return cls("module", name)

    def __str__(self) -> str:
        return f"-m {self.name}" if self.kind == "module" else self.name


def parse_command(args: Sequence[str]) -> tuple[Target, list[str]]:
    """``["-m", "trainer", "--steps", "5"]`` → (module trainer, ["--steps", "5"])."""
    args = list(args)
    if not args or args[0] in ("-h", "--help"):
        raise UsageError(USAGE)
    if args[0] == "-m":
        if len(args) < 2 or not args[1] or args[1].startswith("-"):
            raise UsageError(f"-m needs a module name\n{USAGE}")
        return Target("module", args[1]), args[2:]
    if args[0].startswith("-m") and len(args[0]) > 2:  # python accepts -mtrainer
        return Target("module", args[0][2:]), args[1:]
    if args[0].startswith("-"):
        raise UsageError(f"unknown option {args[0]!r}: python options go to torchrun's "
                         f"interpreter, not to the launcher\n{USAGE}")
    return Target("path", args[0]), args[1:]
