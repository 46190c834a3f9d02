"""The README documents every --rdzv-conf key, with its default, as the code has them."""

import re
from pathlib import Path

from elastic_ext.rendezvous.settings import CONF_KEYS

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_conf_key_is_in_the_readme_table_with_its_default():
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README, flags=re.M))
    for key, (default, _meaning) in CONF_KEYS.items():
        assert key in rows, f"README's configuration table lacks {key}"
        assert rows[key].strip() == (default or "—"), f"README's default for {key}"


def test_readme_has_exactly_the_two_setup_commands_it_promises():
    assert "torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=etcd-ext" in README
    assert "\nbash tests/run.sh\n" in README


def test_every_row_of_the_errors_table_names_tests_that_exist():
    root = Path(__file__).parent.parent
    table = (root / "docs" / "errors.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 25
    for row in rows:
        for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row):
            source = (root / path).read_text()
            assert re.search(rf"^def {name}\(", source, flags=re.M), \
                f"{path}::{name} (row: {row[:60]})"
