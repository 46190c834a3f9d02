"""Writes one line to stdout and one to stderr, and a last word without a newline."""

import json
import os
import sys

from elastic_ext.warm.worker import in_warm_worker


def record(out: str, what: str, **facts: object) -> None:
    facts.update(warm=in_warm_worker(), pid=os.getpid(), ppid=os.getppid())
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(out, f"{what}-rank{os.environ.get('RANK', 'cold')}-gen{gen}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    record(sys.argv[1], "output")
    rank = os.environ["RANK"]
    print(f"warm-stdout-rank{rank}")
    print(f"warm-stderr-rank{rank}", file=sys.stderr)
    sys.stdout.write(f"warm-tail-rank{rank}")  # no newline, no flush: the exit must flush it


if __name__ == "__main__":
    main()
