"""Reads every block file (header, key, payload checksum) and reports damaged files, orphans
(stray or temp files of dead writers, manifest rows without a file) and unindexed block files.
Exit status 1 when something was found and not repaired."""

from __future__ import annotations

import argparse
import shlex
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import KINDS, repair, verify
from paged_cache.cli import render


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the verify subcommand."""
    p = subparsers.add_parser(
        "verify", help="check every block's header and checksum; --repair fixes what it finds",
        description=__doc__)
    render.add_dir_arguments(p)
    p.add_argument("--repair", action="store_true",
                   help="quarantine damaged files (to DIR/quarantine/), remove orphans, adopt "
                        "unindexed files into the manifest")
    p.add_argument("--remove-damaged", action="store_true",
                   help="with --repair: delete damaged files instead of quarantining them")
    p.set_defaults(func=render.dir_command("verify", run))


def run(args: argparse.Namespace, cache: CacheDir) -> int:
    if args.remove_damaged and not args.repair:
        raise ValueError("--remove-damaged: only meaningful with --repair")
    if args.repair:
        render.require_writable(cache, "repair it (run verify without --repair to see what is "
                                       "wrong)")
    files = cache.scan().block_files
    show = not args.json and getattr(sys.stderr, "isatty", lambda: False)()
    with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(file=sys.stderr), disable=not show, transient=True) as bar:
        task = bar.add_task("verify", total=sum(f.size for f in files))
        report = verify(cache, lambda n: bar.advance(task, n))
    if args.repair and report.findings:
        repair(cache, report, quarantine=not args.remove_damaged)
    counts = {kind: report.count(kind) for kind in KINDS}
    unrepaired = [f for f in report.findings if f.action is None]
    status = render.EXIT_DAMAGE if unrepaired else render.EXIT_OK
    if args.json:
        render.print_json({"dir": str(cache.path), "files_checked": report.files_checked,
                           "bytes_checked": report.bytes_checked, "manifest_rows": report.rows,
                           "counts": counts, "repaired": bool(args.repair and report.findings),
                           "findings": [f.to_dict() for f in report.findings], "exit_status": status})
        return status
    out = render.console()
    out.print(f"{cache.path}: checked {report.files_checked} block file(s), "
              f"{render.size(report.bytes_checked)}, {report.rows} manifest row(s)")
    if not report.findings:
        out.print("[green]no problems found[/]")
        return status
    out.print(render.table(
        ", ".join(f"{n} {kind}" for kind, n in counts.items() if n),
        ["kind", "what", "key", "path", "size", "reason", "action"],
        [[f.kind, f.what, render.short(f.key), f.path or "-", render.size(f.bytes), f.reason,
          f.action or "-"] for f in report.findings], right=("size",), optional=("what",)))
    if unrepaired:
        # The directory named, so the line pasted repairs this one (not the default ssd_dir);
        # never wrapped, never read as markup.
        repair_line = shlex.join(["paged-cache", "verify", "--repair", str(cache.path)])
        out.print(f"run `{repair_line}` to fix these", markup=False, soft_wrap=True)
    return status
