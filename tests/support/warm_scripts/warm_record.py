"""What every warm test script writes: ``OUT/<what>-rank<RANK>-gen<RESTART>.json`` with
``warm`` (a test that finds it false ran its worker cold, and proves nothing about warm
starts), its pid and its parent's pid."""

import json
import os

from elastic_ext.warm.worker import in_warm_worker


def record(out: str, what: str, **facts: object) -> None:
    facts.update(warm=in_warm_worker(), pid=os.getpid(), ppid=os.getppid())
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(out, f"{what}-rank{os.environ.get('RANK', 'cold')}-gen{gen}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)
