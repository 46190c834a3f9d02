"""A process that commits snapshots back to back, for tests that SIGKILL it mid-write.

Usage: python snapshot_writer.py DIR STEPS MEGABYTES. Prints "writing K" before each
commit and "durable K" once it is on disk.
"""

from __future__ import annotations

import sys

import torch

from elastic_ext.worker.snapshot import Snapshotter


def main() -> None:
    directory, steps, megabytes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    state = {"w": torch.zeros(int(megabytes * (1 << 20)) // 4)}
    snaps = Snapshotter(directory, keep=3)
    for step in range(1, steps + 1):
        state["w"].fill_(step)
        print(f"writing {step}", flush=True)
        snaps.commit(step, {"state": state, "step": step}).result()
        print(f"durable {step}", flush=True)


if __name__ == "__main__":
    main()
