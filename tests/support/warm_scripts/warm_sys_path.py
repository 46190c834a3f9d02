"""Writes its ``sys.path``, to compare a warm worker's with a cold ``python SCRIPT``'s."""

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


if __name__ == "__main__":
    record(sys.argv[1], "sys-path", sys_path=sys.path, argv=sys.argv)
