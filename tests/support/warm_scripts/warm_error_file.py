"""``@record`` on main, which raises: torchrun's failure report shows the message."""

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record as record_errors

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


@record_errors
def main() -> None:
    record(sys.argv[1], "error")
    raise ValueError(f"warm-marker-{os.environ['RANK']}")


if __name__ == "__main__":
    main()
