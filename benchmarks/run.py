"""Run the benchmarks: ``python -m benchmarks.run [--quick] [--only NAME ...] [--plots-only]``.

Each family (one module) measures its figures against baselines measured in the same run
(``run(ctx)``); the runner draws the family's PNG plots from their JSON form (its ``plots(data,
results)``, the same call ``--plots-only`` makes), writes ``benchmarks/results/<family>.json``,
then ``results.json`` and ``results.md`` (one table of every family's latest figures), and
regenerates the docs' tables from the JSON (benchmarks/doc_tables.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks import doc_tables
from benchmarks.common import RESULTS_DIR, Context, as_json, machine, markdown_table, write_json

FAMILIES = ("restore", "ttft", "remote", "lookup", "startup", "peers", "memory", "engines",
            "sharded", "wear", "scale", "load", "policy", "real", "exo", "trace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (~1-2 min)")
    parser.add_argument("--only", action="append", choices=FAMILIES, metavar="NAME",
                        help=f"run only this family (repeatable): {', '.join(FAMILIES)}")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="output directory")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="directory for SSD-tier files (on the disk to measure; default: a "
                             "temp dir under $TMPDIR)")
    parser.add_argument("--plots-only", action="store_true",
                        help="measure nothing: redraw the plots of the selected families from "
                             "their stored JSON in --results")
    args = parser.parse_args(argv)
    if args.plots_only:
        return replot(args.results, args.only or FAMILIES)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    scratch = Path(tempfile.mkdtemp(prefix="paged-cache-bench-", dir=args.scratch))
    ctx = Context(quick=args.quick, results=args.results, scratch=scratch)
    args.results.mkdir(parents=True, exist_ok=True)
    where = machine()
    try:
        for name in args.only or FAMILIES:
            started = time.perf_counter()
            module = importlib.import_module(f"benchmarks.{name}")
            need = getattr(module, "NEEDS", None)   # an environment variable it cannot run without
            if need and not os.environ.get(need):
                print(f"== {name}: not run, {need} is not set ({module.__doc__.splitlines()[0]})",
                      flush=True)
                continue
            print(f"== {name}", flush=True)
            out = module.run(ctx)
            # every family's plots are drawn from its JSON form, as --plots-only redraws them
            out["plots"] = (module.plots(as_json(out), ctx.results) if hasattr(module, "plots")
                            else [])
            out.update(family=name, quick=args.quick, seconds=time.perf_counter() - started,
                       machine=where)
            write_json(args.results, name, out)
            for f in out["figures"]:
                d = f.to_dict()
                met = {True: "met", False: "MISSED", None: ""}[d["met"]]
                print(f"   {d['name']}: ratio {d['ratio']:.3g} ({d['ratio_meaning']}) {met}",
                      flush=True)
            print(f"   ({out['seconds']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summarize(args.results)
    if args.results.resolve() == RESULTS_DIR.resolve():  # the JSON the docs' tables are drawn from
        for path in doc_tables.rewrite():
            print(f"   tables rewritten: {path.name}", flush=True)
    return 0


def replot(results: Path, names: Sequence[str]) -> int:
    """Redraw each family's plots from ``results/<family>.json`` (families without plots or
    without a stored result are skipped, and said so)."""
    for name in names:
        path = results / f"{name}.json"
        module = importlib.import_module(f"benchmarks.{name}")
        if not hasattr(module, "plots") or not path.exists():
            print(f"== {name}: {'no plots' if path.exists() else f'no {path}'}", flush=True)
            continue
        data = json.loads(path.read_text())
        print(f"== {name}: {', '.join(module.plots(data, results))}", flush=True)
    return 0


def summarize(results: Path) -> None:
    """Merge the latest JSON of every family into results.json and results.md."""
    families, figures = {}, []
    for name in FAMILIES:
        path = results / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if "figures" not in data:  # written by an older standalone script
            continue
        families[name] = data
        figures += data["figures"]
    (results / "results.json").write_text(json.dumps(
        {"families": {n: {k: v for k, v in d.items() if k != "figures"} for n, d in families.items()},
         "figures": figures}, indent=2) + "\n")
    lines = ["# Benchmark results (latest run of each family)", ""]
    for name, data in families.items():
        mode = "quick" if data.get("quick") else "full"
        lines.append(f"- {name}: {mode} run, {data['seconds']:.0f} s, load average "
                     f"{data['machine'].get('load_average')}")
    lines += ["", markdown_table(figures)]
    notes = [(n, note) for n, d in families.items() for note in d.get("notes", [])]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}: {note}" for n, note in notes] + [""]
    (results / "results.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
