"""Shared output of the directory subcommands: rich tables for people, JSON for scripts, errors.

Exit statuses: 0 success, 1 damage found and not repaired (verify) or server unreachable (stats),
2 bad arguments or a path that is not a cache directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from paged_cache.cli.options import add_config_arguments, config_from_args
from paged_cache.config import format_size
from paged_cache.tiers.inventory import CacheDir, NotACacheError
from paged_cache.tiers.manifest import ManifestError

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE = 0, 1, 2
HOT_TIER_NOTE = ("The hot (RAM) tier lives inside each server process and is not visible from "
                 "outside it: these figures cover the SSD tier only (`paged-cache stats` shows a "
                 "running server's hot tier).")
SHORT_KEY = 12
PIPE_WIDTH = 160  # columns when stdout is not a terminal

Handler = Callable[[argparse.Namespace, CacheDir], int]


def console() -> Console:
    """A console on the current sys.stdout (so redirection and capture work); wide when piped."""
    tty = getattr(sys.stdout, "isatty", lambda: False)()
    return Console(file=sys.stdout, highlight=False, soft_wrap=False,
                   width=None if tty else PIPE_WIDTH)


DIR_HELP = "cache directory (default: the effective ssd_dir, see `paged-cache config`)"


def add_dir_arguments(parser: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """DIR (default: the configured ssd_dir), --json, and the shared configuration flags.

    ``positional=False``: the command parses DIR itself and sets ``args.dir``.
    """
    if positional:
        parser.add_argument("dir", nargs="?", metavar="DIR", help=DIR_HELP)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_config_arguments(parser)


def fail(command: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print ``paged-cache COMMAND: error: MESSAGE`` to stderr and return ``status``."""
    print(f"paged-cache {command}: error: {message}", file=sys.stderr)
    return status


def dir_command(command: str, handler: Handler) -> Callable[[argparse.Namespace], int]:
    """Wrap a handler: resolve and open DIR, turning a non-cache path or bad value into exit 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            path = Path(args.dir) if args.dir else config_from_args(args).ssd_dir
            cache = CacheDir(path)
        except (NotACacheError, ManifestError, ValueError) as exc:
            return fail(command, str(exc))
        try:
            return handler(args, cache)
        except (NotACacheError, ManifestError, ValueError) as exc:
            return fail(command, str(exc))

    return run


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(title: str | None, columns: list[str], rows: list[list[Any]], *,
          right: tuple[str, ...] = (), header: bool = True) -> Table:
    """A rich table; columns named in ``right`` are right-aligned (numbers)."""
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, show_header=header)
    for name in columns:
        t.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


def size(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_size(int(nbytes))


def ago(when: float | None, now: float | None = None) -> str:
    """'3m ago' style age of a wall-clock time."""
    if when is None:
        return "-"
    seconds = max(0.0, (time.time() if now is None else now) - when)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


def short(key: str | None) -> str:
    return "-" if not key else key[:SHORT_KEY]


def iso(when: float | None) -> str | None:
    return None if when is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))
