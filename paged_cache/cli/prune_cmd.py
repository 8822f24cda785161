"""`paged-cache prune` and `purge`: remove blocks through the manifest and print what they free."""

from __future__ import annotations

import argparse
import re
from typing import Any

from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import (Victim, delete_blocks, quarantine_files, select_prune,
                                              select_purge)
from paged_cache.cachedir.summary import UNKNOWN_MODEL, resolve_model
from paged_cache.cli import render
from paged_cache.config import parse_size

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw])\s*$")


def parse_duration(text: str, name: str = "--older-than") -> float:
    """Seconds from '90s', '30m', '12h', '7d', '2w'; ValueError naming ``name`` otherwise."""
    match = _DURATION_RE.match(text.lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{name}: expected a number and a unit s/m/h/d/w (e.g. 7d, 12h), got {text!r}")
    return float(match.group(1)) * DURATION_UNITS[match.group(2)]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add prune and purge."""
    p = subparsers.add_parser(
        "prune", help="remove blocks by budget, age or model",
        description="Remove complete blocks (file first, then manifest row). --model and "
                    "--older-than select blocks; with --max-bytes, only the least recently used "
                    "of them until the cache holds at most that many bytes.")
    render.add_dir_arguments(p)
    p.add_argument("--max-bytes", metavar="SIZE", help="shrink the cache to SIZE (e.g. 10GB), LRU first")
    p.add_argument("--older-than", metavar="AGE", help="blocks not used for AGE (e.g. 7d, 12h, 30m)")
    p.add_argument("--model", metavar="FP", help="blocks of this model fingerprint (or a unique prefix)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(func=render.dir_command("prune", run_prune))

    p = subparsers.add_parser(
        "purge", help="remove every block (and quarantined files)",
        description="Remove every complete block, indexed or not, and DIR/quarantine/. Blocks "
                    "being written by a live process are left alone. Needs --yes or --dry-run.")
    render.add_dir_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--yes", action="store_true", help="really remove everything")
    p.set_defaults(func=render.dir_command("purge", run_purge))


def run_prune(args: argparse.Namespace, cache: CacheDir) -> int:
    if args.max_bytes is None and args.older_than is None and args.model is None:
        raise ValueError("give at least one of --max-bytes SIZE, --older-than AGE, --model FP")
    max_bytes = parse_size(args.max_bytes, "--max-bytes") if args.max_bytes is not None else None
    older = parse_duration(args.older_than) if args.older_than is not None else None
    rows = cache.rows()
    model = None
    if args.model is not None:
        model = resolve_model(args.model, (r.fingerprint for r in rows.values() if r.fingerprint))
    victims = select_prune(rows.values(), model=model, older_than=older, max_bytes=max_bytes)
    return _remove(args, cache, "prune", victims)


def run_purge(args: argparse.Namespace, cache: CacheDir) -> int:
    if not (args.yes or args.dry_run):
        raise ValueError("purge removes every block: pass --yes (or --dry-run to see what it would free)")
    quarantined = quarantine_files(cache)
    status = _remove(args, cache, "purge", select_purge(cache),
                     extra={"quarantine_files": len(quarantined),
                            "quarantine_bytes": sum(q.size for q in quarantined)})
    if not args.dry_run:
        for q in quarantined:
            q.path.unlink(missing_ok=True)
    return status


def _remove(args: argparse.Namespace, cache: CacheDir, command: str, victims: list[Victim],
            extra: dict[str, Any] | None = None) -> int:
    if not args.dry_run:
        render.require_writable(cache, f"{command} it (--dry-run shows what {command} would free)")
    models_seen = render.stored_models(cache, cache.rows().values())  # before the files go
    by_model: dict[str, dict[str, int]] = {}
    for v in victims:
        entry = by_model.setdefault(v.fingerprint or UNKNOWN_MODEL, {"blocks": 0, "bytes": 0})
        entry["blocks"] += 1
        entry["bytes"] += v.file_bytes
    planned = sum(v.file_bytes for v in victims)
    freed = planned if args.dry_run else delete_blocks(cache, victims)
    rows = cache.rows()
    if args.dry_run:  # what would remain
        gone = {v.key for v in victims}
        rows = {k: r for k, r in rows.items() if k not in gone}
    data = {"dir": str(cache.path), "dry_run": args.dry_run, "blocks": len(victims),
            "bytes": freed, "by_model": by_model, **(extra or {}),
            "remaining": {"blocks": len(rows), "bytes": sum(r.file_bytes for r in rows.values())},
            "keys": [v.key for v in victims]}
    if args.json:
        render.print_json(data)
        return render.EXIT_OK
    out = render.console()
    verb = "would free" if args.dry_run else "freed"
    out.print(f"{command}: {verb} {render.size(freed)} in {len(victims)} block(s)")
    if by_model:
        out.print(render.table(None, ["model", "blocks", "bytes"],
                               [[render.model_label(fp, models_seen), e["blocks"], render.size(e["bytes"])]
                                for fp, e in sorted(by_model.items())], right=("blocks", "bytes")))
    if extra and extra.get("quarantine_files"):
        out.print(f"quarantine/: {extra['quarantine_files']} file(s), "
                  f"{render.size(extra['quarantine_bytes'])} "
                  f"{'would be removed' if args.dry_run else 'removed'} too")
    out.print(f"{'would remain' if args.dry_run else 'remaining'}: {data['remaining']['blocks']} block(s), "
              f"{render.size(data['remaining']['bytes'])}")
    return render.EXIT_OK
