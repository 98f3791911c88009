"""The docs are runnable: every ```bash block marked `# run-by-tests` in docs/ and README.md runs here
on CPU (in a temp dir, with this venv's `ckpteval` on PATH), and docs/FLAGS.md matches `--help`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BLOCK = re.compile(r"```bash\n# run-by-tests\n(.*?)```", re.S)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            blocks.append((doc.name, i, m.group(1)))
    return blocks


def test_docs_have_runnable_blocks() -> None:
    names = {name for name, _, _ in runnable_blocks()}
    assert {"README.md", "USER_GUIDE.md"} <= names


RUN_NAME = re.compile(r"(?:runs|RUNS)/([\w-]+)")  # runs/NAME, or $RUNS/NAME with RUNS=$PWD/runs


def block_chains(blocks: list[tuple[str, int, str]]) -> list[list[tuple[str, int, str]]]:
    """The blocks in chains, each in document order: blocks naming a common ``runs/<name>`` share a chain (a
    later block uses what an earlier one made there); chains share nothing and may run side by side."""
    chains: list[tuple[set[str], list[tuple[str, int, str]]]] = []
    for block in blocks:
        names = set(RUN_NAME.findall(block[2]))
        joined = [c for c in chains if c[0] & names]
        merged = (names.union(*(c[0] for c in joined)), [b for c in joined for b in c[1]] + [block])
        chains = [c for c in chains if c not in joined] + [merged]
    return [sorted(c[1], key=blocks.index) for c in chains]


@pytest.mark.timeout(1200)  # every runnable block of every doc, demos included: minutes on a loaded 2-core box
def test_doc_commands_run_on_cpu(tmp_path: Path) -> None:
    """Every block, in one directory; the blocks of one chain (:func:`block_chains`) in document order, two
    chains at a time (they wait on their trainers and workers much of the time)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}

    def run_chain(chain: list[tuple[str, int, str]]) -> list[str]:
        for name, i, script in chain:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                return [f"{name} block {i} failed:\n{script}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"]
        return []

    blocks = runnable_blocks()
    chains = sorted(block_chains(blocks), key=len, reverse=True)  # the longest chain starts first
    assert sorted(b for c in chains for b in c) == sorted(blocks) and len(chains) >= 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for fs in pool.map(run_chain, chains) for f in fs]
    assert not failures, "\n\n".join(failures)


def test_doc_blocks_naming_one_run_dir_share_a_chain() -> None:
    """A block that uses a run an earlier block made runs after it, in the same chain."""
    blocks = [("a", 0, "ckpteval train --run-dir runs/x"), ("a", 1, "ls runs/y"), ("a", 2, 'RUN=$PWD/runs/x; ls "$RUN"'),
              ("a", 3, 'cat runs/y/z "$RUNS/w"'), ("a", 4, "echo alone"), ("a", 5, 'ls "$RUNS/w"')]
    assert sorted(block_chains(blocks)) == sorted([[blocks[0], blocks[2]], [blocks[1], blocks[3], blocks[5]], [blocks[4]]])


def test_flags_reference_is_current() -> None:
    from ckpteval.jobs.cli import flag_reference

    current = (ROOT / "docs" / "FLAGS.md").read_text()
    if current.rstrip() != flag_reference().rstrip():
        pytest.fail("docs/FLAGS.md is stale: run `python -m ckpteval.jobs.cli reference > docs/FLAGS.md`")


def test_protocol_layout_lists_every_run_dir_name(tmp_path: Path) -> None:
    """Every name ckpteval.coord.run.rundir.RunDir defines (what a second process reads) is in PROTOCOL.md §1."""
    from ckpteval.coord.run.rundir import RunDir

    run = RunDir(tmp_path)
    names = {getattr(run, attr).name for attr, value in vars(RunDir).items()
             if isinstance(value, property) and isinstance(getattr(run, attr), Path) and getattr(run, attr) != run.path}
    layout = (ROOT / "docs" / "PROTOCOL.md").read_text().split("## 1. Layout", 1)[1].split("## 2.", 1)[0]
    listed = set(re.findall(r"^RUN/([^/\s]+)", layout, re.M))
    assert len(names) >= 12 and names <= listed, f"missing from PROTOCOL.md §1: {sorted(names - listed)}"
    from ckpteval.coord.run.rundir import DUPLICATES, STEP_DIR_PREFIX, STEP_SUMMARY, step_dir_name

    for name in (f"{DUPLICATES}/", f"{STEP_DIR_PREFIX}<S:010d>/", "<unit>.attempts", "<unit>.retry<k>.json",
                 f"{STEP_DIR_PREFIX}<S:010d>/{STEP_SUMMARY}"):
        assert name in layout, f"PROTOCOL.md §1 does not name {name}"
    assert step_dir_name(100) == "step-0000000100"  # what <S:010d> says


FENCE = re.compile(r"^```[^\n`]*\n(.*?)^```\s*$", re.S | re.M)


def empty_fenced_blocks(text: str) -> list[int]:
    """Line numbers of fenced code blocks with nothing in them (a table or output never pasted in)."""
    return [text.count("\n", 0, m.start()) + 1 for m in FENCE.finditer(text) if not m.group(1).strip()]


def test_no_doc_has_an_empty_fenced_block() -> None:
    assert empty_fenced_blocks("a\n```text\n\n```\nb\n```bash\nls\n```\n") == [2]  # the check itself works
    empty = {doc.name: lines for doc in DOCS if (lines := empty_fenced_blocks(doc.read_text()))}
    assert not empty, f"empty fenced blocks (file: opening lines): {empty}"


# -- the code the docs name exists --------------------------------------------------------------------
NAMED_CODE_DOCS = (ROOT / "docs" / "ARCHITECTURE.md", ROOT / "README.md")
DOTTED = re.compile(r"`(ckpteval(?:\.\w+)+)`")
ROOM_PATH = re.compile(r"`((?:jobs|coord)/[\w./]*)`")


def _layout_text(path: Path) -> str:
    """ARCHITECTURE.md whole; README.md's Layout section."""
    text = path.read_text()
    return text if path.name != "README.md" else text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]


def _resolves(dotted: str) -> bool:
    """A module importable, or an attribute of the longest importable prefix (nested attributes allowed)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", NAMED_CODE_DOCS, ids=lambda p: p.name)
def test_every_module_name_and_path_a_doc_names_exists(doc: Path) -> None:
    text = _layout_text(doc)
    dotted, paths = set(DOTTED.findall(text)), set(ROOM_PATH.findall(text))
    assert dotted and paths, f"{doc.name}: no code named (the pattern broke?)"
    assert not sorted(d for d in dotted if not _resolves(d)), f"{doc.name} names code that does not exist"
    assert not sorted(p for p in paths if not (ROOT / p).exists()), f"{doc.name} names paths that do not exist"


def test_the_resolver_refuses_what_is_gone() -> None:
    assert _resolves("ckpteval.coord.run.rundir.RunDir") and _resolves("ckpteval.jobs.trainer.start_eval")
    assert not _resolves("ckpteval.jobs.eval.kinds.UNIT_KINDS") and not _resolves("ckpteval.jobs.eval.envs")
