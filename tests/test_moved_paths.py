"""The import paths of before the layout by process (``elastic_ext.snapshot``,
``elastic_ext.preemption``, ...) still import, as the very modules of their new paths, with
a DeprecationWarning that names the new path (``elastic_ext/_moved.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from elastic_ext._moved import MOVED, new_name

PROBE = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
found = {}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    found[old] = [module is importlib.import_module(new), module.__spec__.name,
                  [str(w.message) for w in caught if w.category is DeprecationWarning]]
from elastic_ext.snapshot.hook import Snapshotter
from elastic_ext.worker.snapshot.hook import Snapshotter as Now
found["submodule"] = [Snapshotter is Now, sys.modules["elastic_ext.snapshot.hook"].__name__, []]
print(json.dumps(found))
"""


def test_every_moved_path_imports_the_same_module_with_a_warning() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(MOVED)], capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).parent.parent))
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    for old, new in MOVED.items():
        same, spec_name, warned = found[old]
        assert same and spec_name == new, (old, found[old])
        assert warned == [f"{old} moved to {new}: import it from there"], (old, warned)
    assert found["submodule"][:2] == [True, "elastic_ext.worker.snapshot.hook"]


def test_only_the_moved_paths_are_redirected() -> None:
    assert new_name("elastic_ext.snapshot.hook") == "elastic_ext.worker.snapshot.hook"
    assert new_name("elastic_ext.snapshots") is None
    assert new_name("elastic_ext.worker.snapshot") is None
    assert new_name("elastic_ext.loop") == "elastic_ext.worker.loop"
    assert new_name("elastic_ext.loop.events") == "elastic_ext.worker.loop.metrics_file"
    assert new_name("elastic_ext.loop.data") == "elastic_ext.worker.loop.data"
