"""The README's framework snippets, run as written: pasted into a script after a preamble
that defines what the snippet says is yours (``model``, ``data``), in one plain process
(world size 1, gloo), as ``tests/test_docs.py`` runs the own-loop example."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "readme-run"


def readme_snippet(marker: str) -> str:
    """The README's python block that contains ``marker``."""
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in b]
    assert len(blocks) == 1, f"the README has {len(blocks)} python blocks with {marker!r}"
    return blocks[0]


def run_snippet(workdir: Path, preamble: str, snippet: str) -> subprocess.CompletedProcess[str]:
    """``preamble`` then ``snippet``, as one script in ``workdir`` (its relative paths
    land there), under torchrun's environment for one worker of run ``RUN_ID``."""
    script = workdir / "snippet.py"
    script.write_text(preamble + "\n" + snippet)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_EXT_", "TORCHELASTIC_"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=RUN_ID,
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=240)
