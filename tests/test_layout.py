"""The tree shows the design: imports point one way between the rooms (docs/ARCHITECTURE.md), the
views and launchers stay light (no torch at import time), no module in jobs/ or coord/ grows past a page
or two, and README's Layout table names what is there."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ROOMS = ("trainer", "eval", "launch", "views", "decide", "reference")

# room -> the rooms it may import (coord at the bottom; reference and cli, the composers, at the top)
ALLOWED = {
    "ckpteval.coord": set(),
    "ckpteval.jobs.lifecycle": set(),
    "ckpteval.jobs.flags": set(),  # the one option mechanism every program's parser uses
    "ckpteval.jobs.pathchecks": set(),  # the flags' path checks
    "ckpteval.jobs.metrics": {"ckpteval.coord"},
    "ckpteval.jobs.ingest": {"ckpteval.coord", "ckpteval.jobs.metrics"},
    "ckpteval.jobs.views": {"ckpteval.coord", "ckpteval.jobs.metrics", "ckpteval.jobs.flags", "ckpteval.jobs.pathchecks"},
    "ckpteval.jobs.decide": {"ckpteval.coord", "ckpteval.jobs.metrics", "ckpteval.jobs.flags", "ckpteval.jobs.pathchecks"},  # decisions from points: read-only, like views
    "ckpteval.jobs.launch": {"ckpteval.coord", "ckpteval.jobs.lifecycle", "ckpteval.jobs.views", "ckpteval.jobs.flags", "ckpteval.jobs.pathchecks"},
    "ckpteval.jobs.eval": {"ckpteval.coord", "ckpteval.jobs.lifecycle", "ckpteval.jobs.metrics", "ckpteval.jobs.ingest", "ckpteval.jobs.flags", "ckpteval.jobs.pathchecks"},
    "ckpteval.jobs.trainer": {"ckpteval.coord", "ckpteval.jobs.lifecycle", "ckpteval.jobs.metrics", "ckpteval.jobs.ingest", "ckpteval.jobs.eval", "ckpteval.jobs.flags", "ckpteval.jobs.pathchecks"},
}
# single module-level exceptions, each with its reason
EXCEPTIONS = {
    ("ckpteval.jobs.eval.kinds.generate.evalsets", "ckpteval.jobs.reference.model"): "the built-in addition eval set is the reference task's",
    # submit checks on the submit host what the job would refuse, with the programs' own parsers and
    # readers (imported lazily: no torch at import time, see test_views_and_launchers_import_no_torch)
    ("ckpteval.jobs.launch.submit_checks", "ckpteval.jobs.eval.worker.options"): "the worker's own option checks",
    ("ckpteval.jobs.launch.submit_checks", "ckpteval.jobs.eval.worker.evalconfig"): "the one eval-config reader",
    ("ckpteval.jobs.launch.submit", "ckpteval.jobs.eval.worker.reeval"): "the re-evaluation plan (validated before sbatch)",
    ("ckpteval.jobs.launch.submit_checks", "ckpteval.jobs.reference.train.config"): "the reference trainer's own flag checks",
    ("ckpteval.jobs.views.noise", "ckpteval.jobs.decide"): "status shows the decisions' MDE, computed one way (#29)",
    ("ckpteval.jobs.views.status.data", "ckpteval.jobs.eval.catalog.reference"): "status shows the step-0 check against "
    "the catalog's published scores, computed one way (#41)",
}


def room_of(module: str) -> str | None:
    parts = module.removeprefix("ckpteval.").split(".")
    if parts[0] == "coord":
        return "ckpteval.coord"
    if parts[0] != "jobs" or len(parts) == 1:
        return None
    return f"ckpteval.jobs.{parts[1]}"


def module_of(path: Path) -> str:
    """``jobs/eval/worker/main.py`` -> ``ckpteval.jobs.eval.worker.main`` (the folders install under ckpteval, setup.py)."""
    return "ckpteval." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_imports_point_one_way_between_rooms() -> None:
    bad = []
    for path in sorted([*ROOT.glob("coord/**/*.py"), *ROOT.glob("jobs/**/*.py")]):
        module = module_of(path)
        room = room_of(module)
        if room not in ALLOWED:
            continue  # ckpteval.jobs.reference and ckpteval.jobs.cli compose everything
        for target in imports(path):
            other = room_of(target)
            if other in (None, room) or other in ALLOWED[room]:
                continue
            if not any(module == m and target.startswith(t) for m, t in EXCEPTIONS):
                bad.append(f"{module} imports {target} ({room} -> {other})")
    assert not bad, "\n".join(bad)


# Import cycles that stay, each with its reason (a deferred import that keeps a slow one off a light path)
KNOWN_CYCLES = {
    frozenset({"ckpteval.jobs.reference.train.main", "ckpteval.jobs.reference.train.config"}):
        "train_config's main imports the trainer (torch) only after its flags validated",
}


def module_imports(path: Path) -> dict[str, int]:
    """The ckpteval modules ``path`` imports (top-level and in functions; not ``if TYPE_CHECKING:``
    blocks), each with the line of its first import: ``from a.b import c`` counts ``a.b.c`` when that
    is a module, else ``a.b``; relative imports are resolved."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    package = module_of(path).split(".")[: None if path.name == "__init__.py" else -1]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], node.module or ""]).strip(".") \
                if node.level else node.module or ""
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            if name.startswith("ckpteval."):
                found.setdefault(name, node.lineno)
    return found


def import_graph(paths: list[Path]) -> dict[str, dict[str, int]]:
    """module -> {module of the tree it imports: line}; a name that is no module counts as its package."""
    modules = {module_of(p): p for p in paths}

    def resolve(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for name, line in module_imports(path).items():
            if (target := resolve(name)) in modules and target != module:
                graph[module].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_jobs_has_no_import_cycle() -> None:
    """Every import of a ckpteval module by a module of jobs/, in a function or not, points down: a cycle
    (printed with the line of each import in it) is a leaf in the wrong module."""
    graph = import_graph(sorted(ROOT.glob("jobs/**/*.py")))
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles in jobs/:\n" + "\n".join(
        f"{len(c)} modules: " + "; ".join(f"{m} -> {t} (line {graph[m][t]})" for m in c for t in graph[m] if t in c)
        for c in found)


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check above on a known graph: a -> b -> c -> a is one cycle, d alone none."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["ckpteval.jobs.views", "ckpteval.jobs.launch", "ckpteval.jobs.decide"])
def test_views_and_launchers_import_no_torch(package: str) -> None:
    """Checked in a fresh interpreter: ``sys.modules`` after importing every module of the room."""
    modules = [module_of(p) for p in sorted((ROOT / package.removeprefix("ckpteval.").replace(".", "/")).rglob("*.py"))]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in ('torch', 'transformers', 'safetensors.torch') if k in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.strip() == "[]", f"{package} pulls in {proc.stdout.strip()} at import time"


def test_no_module_in_jobs_or_coord_is_near_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in [*ROOT.glob("jobs/**/*.py"), *ROOT.glob("coord/**/*.py")]
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these along their seams: {long}"


LOOSE_FILES = 12  # a folder's own modules (besides __init__.py): past this, its concepts want folders of their own


def test_no_folder_in_jobs_or_coord_has_many_loose_modules() -> None:
    """A concept that outgrows one module becomes a folder named for it, never prefix-named siblings: no
    folder of jobs/ or coord/ holds more than LOOSE_FILES modules of its own."""
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "jobs", ROOT / "coord", *ROOT.glob("jobs/**/"), *ROOT.glob("coord/**/")]
               if d.is_dir() and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > LOOSE_FILES}
    assert not crowded, f"give these folders' concepts rooms of their own: {crowded}"


def test_readme_layout_table_matches_the_tree() -> None:
    """Every path README's Layout table names exists, and every room of jobs/ (of jobs/eval/, its rooms) is named there."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"README's Layout names paths that do not exist: {missing}"
    eval_rooms = {f"jobs/eval/{d.name}/" for d in (ROOT / "jobs" / "eval").iterdir() if (d / "__init__.py").exists()}
    rooms = {f"jobs/{r}/" for r in ROOMS if r != "eval"} | eval_rooms | {"coord/", "sbatch/", "tests/", "bench/", "docs/"}
    assert rooms <= named, f"README's Layout does not name {sorted(rooms - named)}"
