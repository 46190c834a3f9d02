"""Leaves as told: ``OUT 3`` exits 3, ``OUT SIGKILL`` / ``OUT SIGSEGV`` kills itself."""

import json
import os
import resource
import signal
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
    out, how = sys.argv[1], sys.argv[2]
    record(out, "exit")
    if how.isdigit():
        sys.exit(int(how))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.kill(os.getpid(), getattr(signal, how))


if __name__ == "__main__":
    main()
