"""``@record`` on main, which raises: torchrun's failure report shows the message."""

import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record as record_errors

from elastic_ext.warm.worker import in_warm_worker


def record(out: str, what: str, **facts: object) -> None:
    facts.update(warm=in_warm_worker(), pid=os.getpid(), ppid=os.getppid())
    gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(out, f"{what}-rank{os.environ.get('RANK', 'cold')}-gen{gen}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


@record_errors
def main() -> None:
    record(sys.argv[1], "error")
    raise ValueError(f"warm-marker-{os.environ['RANK']}")


if __name__ == "__main__":
    main()
