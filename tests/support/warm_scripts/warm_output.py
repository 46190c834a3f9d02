"""Writes one line to stdout and one to stderr, and a last word without a newline."""

import os
import sys

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


def main() -> None:
    record(sys.argv[1], "output")
    rank = os.environ["RANK"]
    print(f"warm-stdout-rank{rank}")
    print(f"warm-stderr-rank{rank}", file=sys.stderr)
    sys.stdout.write(f"warm-tail-rank{rank}")  # no newline, no flush: the exit must flush it


if __name__ == "__main__":
    main()
