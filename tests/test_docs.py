"""The README and docs/ say what the code does: settings, commands, links, the example loop.

Every check here reads files or builds argument parsers; none starts an agent, etcd or a
network namespace. The one subprocess runs the README's own-loop example in a single
plain Python process (world size 1, gloo).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from elastic_ext.rendezvous.errors import ConfigError
from elastic_ext.rendezvous.settings import CONF_KEYS, parse_settings
from elastic_ext.rendezvous.torch_conf import TORCH_KEYS

ROOT = Path(__file__).parent.parent
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAIN_JOB_PREFIX = "pip install torch==2.13.0 '.[progress]' && "
MAX_README_LINES = 300


# ------------------------------------------------------------------------------ helpers
def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block, in order."""
    return [(m[1].strip(), m[2])
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```[ \t]*$", text, flags=re.M | re.S)]


def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code spans blanked out (links inside are not
    links)."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "``", text)


def section(text: str, title_start: str) -> str:
    """The body of the ``## `` section whose title starts with ``title_start``."""
    match = re.search(rf"^## {re.escape(title_start)}.*?$(.*?)(?=^## |\Z)", text,
                      flags=re.M | re.S)
    assert match, f"no section '## {title_start}...'"
    return match[1]


def command_lines(block: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, ``$ `` and comments cut."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line.strip())
        lines.append(line[2:] if line.startswith("$ ") else line)
    return [line for line in lines if line]


def option_names(parser: argparse.ArgumentParser) -> set[str]:
    return {name for action in parser._actions for name in action.option_strings}


def unknown_options(tokens: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Options in ``tokens`` that ``parser`` does not define under exactly that name
    (argparse would take an abbreviation; a renamed flag must fail here)."""
    known = option_names(parser)
    return [t for t in tokens if t.startswith("-") and t.split("=", 1)[0] not in known]


def parse(parser: argparse.ArgumentParser, tokens: list[str], what: str) -> argparse.Namespace:
    try:
        return parser.parse_args(tokens)
    except SystemExit as exc:  # argparse printed why on stderr
        pytest.fail(f"{what} does not parse: {shlex.join(tokens)} (exit {exc.code})")


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def trainer_parser() -> argparse.ArgumentParser:
    from trainer.cli import build_parser

    return build_parser()


def check_torchrun_command(command: str) -> argparse.Namespace:
    """torchrun's own parser takes every torchrun flag of ``command`` by its exact name,
    and with ``-m trainer`` the trainer's parser takes the rest."""
    tokens = shlex.split(command)
    assert tokens[0] == "torchrun", command
    args = parse(torchrun_parser(), tokens[1:], "torchrun")
    script_args = list(args.training_script_args)
    launcher = tokens[1:len(tokens) - len(script_args)]
    assert not unknown_options(launcher, torchrun_parser()), \
        f"torchrun has no option {unknown_options(launcher, torchrun_parser())}: {command}"
    if args.module and args.training_script == "trainer":
        parse(trainer_parser(), script_args, "the trainer's arguments")
        assert not unknown_options(script_args, trainer_parser()), \
            f"the trainer has no option {unknown_options(script_args, trainer_parser())}"
    return args


def main_job() -> str:
    setup = section(README, "Set-up")
    jobs = [line for _, body in fenced_blocks(setup) for line in command_lines(body)
            if line.startswith(MAIN_JOB_PREFIX)]
    assert len(jobs) == 1, "the README's main job command is missing or there twice"
    return jobs[0][len(MAIN_JOB_PREFIX):]


def github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for the headings of ``path`` (duplicates get -1, -2...)."""
    seen: Counter[str] = Counter()
    found = set()
    text = re.sub(r"^```.*?^```[ \t]*$", "", path.read_text(), flags=re.M | re.S)
    for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = github_slug(match[1])
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def relative_links(path: Path) -> list[str]:
    link = r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)"
    targets = re.findall(link, without_code(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


# ------------------------------------------------------------------- the configuration table
def test_every_conf_key_is_in_the_readme_table_with_its_default_and_meaning() -> None:
    rows = {key: (default, meaning, torch) for key, default, meaning, torch
            in re.findall(r"^\| `(\w+)` \| ([^|]+) \| (.*) \|([^|]*)\|$", README, flags=re.M)}
    for key, (default, meaning) in CONF_KEYS.items():
        assert key in rows, f"README's configuration table lacks {key}"
        assert rows[key][0].strip() == (default or "—"), f"README's default for {key}"
        assert rows[key][1].strip() == meaning, \
            f"README's meaning of {key} is not CONF_KEYS' (settings.py): {meaning}"
        assert rows[key][2].strip() == TORCH_KEYS.get(key, ""), \
            f"README's torch column of {key} is not TORCH_KEYS' (settings.py)"
    table = section(README, "Configuration")
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    assert documented <= set(CONF_KEYS), f"README documents keys the code does not accept: " \
                                         f"{sorted(documented - set(CONF_KEYS))}"


def test_the_embedded_store_takes_one_endpoint_as_the_readme_says() -> None:
    conf: dict[str, str] = {}
    single = parse_settings(endpoint="c10d://node1:29400", run_id="r", min_nodes=1,
                            max_nodes=2, conf=conf)
    assert single.store == "c10d" and len(single.endpoints) == 1
    with pytest.raises(ConfigError, match="etcd"):
        parse_settings(endpoint="c10d://node1:29400,node2:29400", run_id="r", min_nodes=1,
                       max_nodes=2, conf=conf)


# ---------------------------------------------------------------------- the set-up commands
def test_readme_has_exactly_the_two_setup_commands_it_promises() -> None:
    setup = section(README, "Set-up")
    commands = [line for _, body in fenced_blocks(setup) for line in command_lines(body)]
    assert len(commands) == 2, f"the set-up section has {len(commands)} commands: {commands}"
    assert commands[0].startswith(MAIN_JOB_PREFIX + "torchrun --nnodes=1:2 --nproc-per-node=2 "
                                  "--rdzv-backend=etcd-ext")
    assert commands[1] == "bash tests/run.sh"
    assert "\nbash tests/run.sh\n" in README


def test_the_main_job_runs_the_bundled_trainer_on_etcd_ext_with_flags_that_exist() -> None:
    args = check_torchrun_command(main_job())
    assert args.rdzv_backend == "etcd-ext"
    assert not args.rdzv_endpoint, "the main job runs on the embedded store's default"
    assert args.module and args.training_script == "trainer"
    settings = trainer_parser().parse_args(args.training_script_args)
    assert settings.snapshot_dir is not None and settings.snapshot_every > 0
    assert settings.metrics is not None


def test_every_complete_torchrun_command_in_the_readme_parses() -> None:
    commands = [line for info, body in fenced_blocks(README) if info in ("", "sh", "bash")
                for line in command_lines(body) if line.startswith("torchrun ")]
    assert len(commands) >= 2
    for command in commands:
        if "..." in shlex.split(command):  # a sketch: its flags still have to exist
            tokens = shlex.split(command)[1:]
            shown = tokens[:tokens.index("...")]
            assert not unknown_options(shown, torchrun_parser()), command
            continue
        check_torchrun_command(command)


def test_tests_run_sh_exists_and_accepts_fast() -> None:
    script = ROOT / "tests" / "run.sh"
    assert script.is_file(), "the README's test command runs tests/run.sh"
    code = [line for line in script.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert any("--fast" in line for line in code), \
        "the README documents `bash tests/run.sh --fast`, and tests/run.sh does not handle it"
    assert "bash tests/run.sh --fast" in README


def test_the_readme_leaves_no_more_than_the_three_measurement_placeholders() -> None:
    # no placeholder left for a measurement
    # may be left to be determined.
    assert not re.findall(r"\bTBD", README)
    assert "TBD" not in "".join(path.read_text() for path in DOCS)


# ----------------------------------------------------------------- elastic-ext's own commands
def elastic_ext_parsers() -> dict[str, argparse.ArgumentParser]:
    from elastic_ext.ops.cli import SUBCOMMANDS

    parsers = {}
    for name, (module_name, _help) in SUBCOMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"elastic-ext {name}")
        importlib.import_module(module_name).add_arguments(parser, name)
        parsers[name] = parser
    return parsers


def test_every_elastic_ext_command_in_the_docs_uses_options_that_exist() -> None:
    parsers = elastic_ext_parsers()
    checked = 0
    for path in [README_PATH, *DOCS]:
        for _info, body in fenced_blocks(path.read_text()):
            for line in command_lines(body):
                if not line.startswith("elastic-ext ") or "[" in line or "|" in line:
                    continue  # output, or a synopsis with optional parts
                tokens = shlex.split(line)
                assert tokens[1] in parsers, f"{path.name}: no subcommand {tokens[1]!r}: {line}"
                if parsers[tokens[1]].get_default("_accepts_rest") and "-m" in tokens:
                    tokens = tokens[:tokens.index("-m")]  # doctor: a torchrun line, its script
                bad = unknown_options(tokens[2:], parsers[tokens[1]])
                assert not bad, f"{path.name}: elastic-ext {tokens[1]} has no option {bad}"
                checked += 1
    assert checked >= 5


# ------------------------------------------------------------------------------ the trainer
def test_the_trainer_docs_list_every_flag_of_the_trainer() -> None:
    table = (ROOT / "docs" / "trainer.md").read_text()
    documented = set(re.findall(r"`(--[\w-]+)", table))
    for action in trainer_parser()._actions:
        for name in action.option_strings:
            if name.startswith("--") and name != "--help":
                assert name in documented, f"docs/trainer.md does not document {name}"
    assert documented <= option_names(trainer_parser()) | {"--tee", "--redirects",
                                                           "--shutdown-timeout"}, \
        f"docs/trainer.md names flags the trainer lacks: " \
        f"{sorted(documented - option_names(trainer_parser()))}"


# ---------------------------------------------------------------------- links and paths
@pytest.mark.parametrize("path", [README_PATH, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(path: Path) -> None:
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), \
                f"{path.name}: link to {target}: no heading with that anchor in {linked.name}"


@pytest.mark.parametrize("path", [README_PATH, *DOCS], ids=lambda p: p.name)
def test_every_repository_path_the_docs_name_exists(path: Path) -> None:
    named = re.findall(r"`((?:elastic_ext|trainer|tests|deploy|benchmarks|docs)/[\w./-]*\w)"
                       r"(?:::\w+)?`", path.read_text())
    for name in named:
        assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"


def test_every_module_the_docs_name_by_file_name_exists() -> None:
    """`policy.py`, `snapshot/agreement.py`: a file of that name (or path tail) exists."""
    sources = [p.relative_to(ROOT).as_posix() for pattern in ("*.py", "*.sh")
               for p in ROOT.rglob(pattern) if ".git" not in p.parts]
    for path in [README_PATH, *DOCS]:
        for name in re.findall(r"`([\w/.-]+\.(?:py|sh))`", path.read_text()):
            if name.startswith("torch/"):  # torch's own sources, in its wheel
                continue
            assert any(s == name or s.endswith("/" + name) for s in sources), \
                f"{path.name} names {name}, and no such file exists"


def test_readme_is_short_enough_to_read() -> None:
    lines = len(README.splitlines())
    assert lines <= MAX_README_LINES, \
        f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_the_readme_links_every_page_in_docs() -> None:
    linked = {Path(target.partition("#")[0]).name for target in relative_links(README_PATH)}
    for page in DOCS:
        assert page.name in linked, f"README.md does not link docs/{page.name}"


# ------------------------------------------------------------------- the own-loop example
def python_blocks(path: Path) -> list[str]:
    blocks = [body for info, body in fenced_blocks(path.read_text()) if info == "python"]
    assert blocks, f"{path.name} has no python example"
    return blocks


HOOK_DOC = ROOT / "docs" / "snapshot-hook.md"


def test_the_own_loop_example_is_the_same_in_the_readme_and_the_hook_docs() -> None:
    readme, hook = python_blocks(README_PATH)[0], python_blocks(HOOK_DOC)
    assert readme in hook[0], "docs/snapshot-hook.md's first example must be the README's, " \
                              "with its imports"
    assert "ElasticLoop(" in readme and "loop.step_done(" in readme
    pieces = hook[1]  # the same loop on the pieces underneath
    assert "agreed.restart" in pieces and "keep_state" in pieces and "HeldStep" in pieces


LOOP_PIECES = '''
def build():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 10)

def next_batch(position):
    return torch.ones(2, 4), {"epoch": position["epoch"], "offset": position["offset"] + 2}

def forward_backward(ddp, batch):
    loss = ddp(batch).pow(2).mean()
    loss.backward()
    return loss

total_steps = 4
dataset = torch.arange(256.0).reshape(64, 4) / 256

# an earlier run's snapshot of step 2, for the example to resume from
_model, _optimizer, _scheduler = build()
Snapshotter(SNAPSHOTS).commit_now(2, {"model": _model, "optimizer": _optimizer,
                                      "scheduler": _scheduler, "data": {"epoch": 0, "offset": 4}})
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_example(tmp_path: Path, body: str, first_line: str, report: str
                ) -> subprocess.CompletedProcess[str]:
    """The example as written, in one plain process (world size 1, gloo), resuming from a
    snapshot of step 2 and training to step 4."""
    assert '"/local/run42/snapshots"' in body
    body = body.replace('"/local/run42/snapshots"', "SNAPSHOTS")
    imports, _, loop = body.partition(f"\n{first_line}")
    script = tmp_path / "loop.py"
    script.write_text(imports + "\nfrom elastic_ext.worker.snapshot import Snapshotter\n"
                      + f"\nSNAPSHOTS = {str(tmp_path / 'snapshots')!r}\n" + LOOP_PIECES
                      + f"\n{first_line}" + loop + report)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTIC_EXT_", "TORCHELASTIC_"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "snapshots" / "snapshot-0000000004.json").is_file()
    return done


def test_the_own_loop_example_resumes_trains_and_snapshots(tmp_path: Path) -> None:
    done = run_example(tmp_path, python_blocks(HOOK_DOC)[0], "loop = ",
                       'print("ended at", loop.step, "data", loop._position, flush=True)\n')
    # resumed at sample 4 of epoch 0: step 3 takes 4..35, step 4 starts epoch 1 (68 > 64)
    assert "ended at 4 data DataPosition(epoch=1, offset=32)" in done.stdout, \
        done.stdout + done.stderr[-3000:]


def test_the_example_on_the_pieces_underneath_resumes_trains_and_snapshots(
        tmp_path: Path) -> None:
    done = run_example(tmp_path, python_blocks(HOOK_DOC)[1], "guard = ",
                       'print("resumed from", restored.step if restored else None, "ended at",'
                       ' step, "data", position, flush=True)\nexit_now(0)\n')
    assert "resumed from 2 ended at 4 data {'epoch': 0, 'offset': 8}" in done.stdout, \
        done.stdout + done.stderr[-3000:]
