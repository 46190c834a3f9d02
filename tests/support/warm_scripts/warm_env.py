"""Generation 0 leaves things behind (an environment variable set both ways, a umask, a
working directory, a lower file limit) and exits 1; generation 1 waits for ``OUT/go``
and writes what it found: its environment (Python's and the C library's), cwd, umask,
file limit and ``sys.path``."""

import ctypes
import os
import resource
import sys
import time

try:  # run as a script: this directory is sys.path[0]
    from warm_record import record  # type: ignore[import-not-found]
except ImportError:  # run as a module: python -m tests.support.warm_scripts.NAME
    from tests.support.warm_scripts.warm_record import record

WAIT_S = 60.0


def c_environ() -> dict[str, str]:
    """The C library's ``environ``: what an exec'd child or a C extension sees."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    found: dict[str, str] = {}
    i = 0
    while environ[i] is not None:
        key, _, value = environ[i].decode(errors="replace").partition("=")
        found[key] = value
        i += 1
    return found


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def wait_for(*paths: str) -> bool:
    """Whether every one of ``paths`` exists within ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not all(map(os.path.exists, paths)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main() -> None:
    out = sys.argv[1]
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.environ["LEFTOVER"] = "generation 0"
        os.putenv("PUTENV_LEFTOVER", "generation 0")
        os.umask(0o077)
        os.chdir("/")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard - 1))
        record(out, "left")
        # Every rank records before any fails: torchrun stops the others as soon as one
        # exits 1, and a rank slower to start (a loaded machine) would never record.
        wait_for(*(os.path.join(out, f"left-rank{r}-gen0.json")
                   for r in range(int(os.environ["WORLD_SIZE"]))))
        sys.exit(1)
    record(out, "ready")
    if not wait_for(os.path.join(out, "go")):
        sys.exit(4)
    record(out, "found", environ=dict(os.environ), c_environ=c_environ(), cwd=os.getcwd(),
           umask=umask(), nofile=list(resource.getrlimit(resource.RLIMIT_NOFILE)),
           sys_path=sys.path)


if __name__ == "__main__":
    main()
