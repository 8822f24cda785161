"""The benchmark tables of README.md and docs/*.md, generated from benchmarks/results/*.json so
that a table shows what the stored run measured: ``python -m benchmarks.doc_tables`` rewrites
them (the runner does after every run into benchmarks/results), ``--check`` only says which
differ, and tests/test_doc_tables.py fails on any that does.

A generated table sits between ``<!-- bench-table SPEC -->`` and ``<!-- /bench-table -->``.
SPEC is one or more family names (every figure of those families, in results.md's columns) or
``FAMILY:VIEW``, a table the family's module draws from its JSON (its ``tables(data)`` returns
the views by name, as its ``plots`` draws PNGs): a new family needs nothing to be tabled. Each
table opens with the run it comes from. Numbers quoted in prose carry tests/test_readme_figures.py's
``<!-- bench FAMILY "figure" field -->`` markers instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/*.md")
BLOCK = re.compile(r"(?P<open><!-- bench-table (?P<spec>[^>]*?) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- /bench-table -->)", re.S)


def load(family: str, results: Path = RESULTS_DIR) -> dict[str, Any]:
    """A family's stored result; ValueError naming the file when it is missing or has no figures."""
    path = results / f"{family}.json"
    if not path.is_file():
        raise ValueError(f"bench-table {family}: no {path} (run `python -m benchmarks.run --only "
                         f"{family}`)")
    data = json.loads(path.read_text())
    if "figures" not in data:
        raise ValueError(f"bench-table {family}: {path} has no figures")
    return data


def provenance(family: str, data: dict[str, Any]) -> str:
    """What names the run a table comes from: its file, mode, date and machine load."""
    where = data.get("machine", {})
    facts = [f"{'quick' if data.get('quick') else 'full'} run" + (
        f" of {where['date']}" if "date" in where else "")]
    if "backend" in where:
        facts.append(f"MLX {where.get('mlx', '?')} {where['backend']} backend")
    if where.get("cpus"):
        facts.append(f"{where['cpus']} CPUs")
    if where.get("load_average"):
        facts.append(f"load average {where['load_average'][0]:g} at its start")
    return f"`benchmarks/results/{family}.json`: {', '.join(facts)}"


def render(spec: str, results: Path = RESULTS_DIR) -> str:
    """The generated text of one table block (without its markers)."""
    names = spec.split()
    if not names:
        raise ValueError("bench-table: the marker names no family")
    if len(names) == 1 and ":" in names[0]:
        family, view = names[0].split(":", 1)
        data = load(family, results)
        module = importlib.import_module(f"benchmarks.{family}")
        views = module.tables(data) if hasattr(module, "tables") else {}
        if view not in views:
            raise ValueError(f"bench-table {spec}: benchmarks/{family}.py draws no table "
                             f"{view!r} (it draws: {', '.join(views) or 'none'})")
        stored, body = {family: data}, views[view]
    else:
        stored = {name: load(name, results) for name in names}
        body = markdown_table([f for data in stored.values() for f in data["figures"]])
    runs = [provenance(name, data) for name, data in stored.items()]
    head = f"*{runs[0]}.*" if len(runs) == 1 else "\n".join(f"- {run}" for run in runs)
    return head + "\n\n" + body.rstrip("\n") + "\n"


def refresh(text: str, results: Path = RESULTS_DIR) -> str:
    """``text`` with every table block regenerated."""
    return BLOCK.sub(lambda m: m["open"] + render(m["spec"], results) + m["close"], text)


def documents(root: Path = ROOT) -> list[Path]:
    """The documents that may hold table blocks."""
    return sorted(p for pattern in DOCUMENTS for p in root.glob(pattern))


def rewrite(results: Path = RESULTS_DIR, root: Path = ROOT, check: bool = False) -> list[Path]:
    """Regenerate every document's tables (only compare when ``check``); the documents that
    changed (or would)."""
    changed = []
    for path in documents(root):
        text = path.read_text()
        new = refresh(text, results)
        if new != text:
            changed.append(path)
            if not check:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the JSON's directory")
    parser.add_argument("--check", action="store_true",
                        help="change nothing: list the documents whose tables differ (status 1)")
    args = parser.parse_args(argv)
    changed = rewrite(args.results, check=args.check)
    for path in changed:
        print(f"{'differs' if args.check else 'rewritten'}: {path.relative_to(ROOT)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
