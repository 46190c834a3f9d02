"""Writes its ``sys.path``, to compare a warm worker's with a cold ``python SCRIPT``'s."""

import sys

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record


if __name__ == "__main__":
    record(sys.argv[1], "sys-path", sys_path=sys.path, argv=sys.argv)
