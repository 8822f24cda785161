"""The package's shape: one installed top-level package, no import cycle, no module over the
size a reader takes in at once."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "paged_cache"
MAX_MODULE_LINES = 600


def module_name(path: Path, root: Path) -> str:
    """The dotted name of a module file of the package whose folder is ``root``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports: at its top level, inside a function
    or for type checking alike."""
    found: set[str] = set()
    here = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return {m for m in found if m in known and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module under ``root``."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    return {name: imported_modules(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module, and every module importing
    itself: each is an import cycle (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


@pytest.mark.unit
def test_the_scheduler_is_part_of_the_package() -> None:
    import paged_cache
    from paged_cache.scheduler import Scheduler
    assert paged_cache.Scheduler is Scheduler and "Scheduler" in dir(paged_cache)
    assert not (ROOT / "scheduler").exists()


@pytest.mark.unit
def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph(PACKAGE)
    assert "paged_cache.tiers.ssd.tier" in graph and graph["paged_cache.manager"]
    assert cycles(graph) == [], "modules that import each other, directly or through others"


@pytest.mark.unit
def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "paged_cache"
    (pkg / "tiers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiers" / "__init__.py").write_text("")
    (pkg / "rates.py").write_text("from paged_cache.rates_file import SavedRates\n")
    (pkg / "rates_file.py").write_text("def f():\n    from paged_cache import rates\n")
    (pkg / "tiers" / "a.py").write_text("from . import b\n")
    (pkg / "tiers" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from paged_cache.tiers import a\n")
    (pkg / "tiers" / "c.py").write_text("from paged_cache.tiers.a import x\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["paged_cache.rates", "paged_cache.rates_file"],
                             ["paged_cache.tiers.a", "paged_cache.tiers.b"]]
    assert graph["paged_cache.tiers.c"] == {"paged_cache.tiers.a"}


@pytest.mark.unit
def test_no_module_is_over_the_size_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: split them by what they hold"


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    """The wheel ``pip install`` builds, from a copy of the tree (a build leaves ``build/``)."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "benchmarks", "tests"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--quiet", "-w", str(tmp_path), str(source)],
                          timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel, = tmp_path.glob("paged_cache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert top == {"paged_cache"}
        assert "paged_cache/scheduler/engine.py" in names
        listed = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert archive.read(listed).decode().split() == ["paged_cache"]
