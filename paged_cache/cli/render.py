"""Shared output of the directory subcommands: rich tables for people, JSON for scripts, errors.

Exit statuses: 0 success, 1 damage found and not repaired (verify) or server unreachable (stats),
2 bad arguments or a path that is not a cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from rich.console import Console
from rich.table import Table

from paged_cache.cachedir.inventory import CacheDir, NotACacheError, read_header
from paged_cache.cli.options import add_config_arguments, config_from_args
from paged_cache.config import format_size
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.manifest import COMPLETE, ManifestError, Row

EXIT_OK, EXIT_DAMAGE, EXIT_USAGE = 0, 1, 2
HOT_TIER_NOTE = ("The hot (RAM) tier lives inside each server process and is not visible from "
                 "outside it: these figures cover the SSD tier only (`paged-cache stats` shows a "
                 "running server's hot tier).")
SHORT_KEY = 12
PIPE_WIDTH = 160  # columns when stdout is not a terminal and COLUMNS is not set

Handler = Callable[[argparse.Namespace, CacheDir], int]


class _Console(Console):
    """rich's Console, leaving a closed pipe to the command's entry point (one exit status for
    every output, see cli.main) instead of exiting 1 itself."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def sized_output() -> bool:
    """Whether stdout has a width to fit: a terminal, or $COLUMNS set."""
    tty = getattr(sys.stdout, "isatty", lambda: False)()
    return tty or os.environ.get("COLUMNS", "").isdigit()


def console() -> Console:
    """A console on the current sys.stdout (so redirection and capture work); the terminal's (or
    $COLUMNS) width, PIPE_WIDTH when piped without COLUMNS."""
    return _Console(file=sys.stdout, highlight=False, soft_wrap=False,
                    width=None if sized_output() else PIPE_WIDTH)


DIR_HELP = "cache directory (default: the effective ssd_dir, see `paged-cache config`)"


def add_dir_arguments(parser: argparse.ArgumentParser, *, positional: bool = True,
                      fields: tuple[str, ...] = ("ssd_dir",)) -> None:
    """DIR (default: the configured ssd_dir), --json, --config and the flags of ``fields`` (the
    configuration a directory command reads: ssd_dir for its default DIR).

    ``positional=False``: the command parses DIR itself and sets ``args.dir``.
    """
    if positional:
        parser.add_argument("dir", nargs="?", metavar="DIR", help=DIR_HELP)
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_config_arguments(parser, fields)


def say(line: str) -> None:
    """One plain line of progress on stderr (kept by a log file or CI as on a terminal; stdout
    keeps the command's result)."""
    print(line, file=sys.stderr, flush=True)


def fail(command: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print ``paged-cache COMMAND: error: MESSAGE`` to stderr and return ``status``."""
    print(f"paged-cache {command}: error: {message}", file=sys.stderr)
    return status


def config_command(command: str, handler: Callable[[argparse.Namespace, Any], int]
                   ) -> Callable[[argparse.Namespace], int]:
    """Wrap a handler: build the CacheConfig of the flags, environment and file, turning an invalid
    value into exit status 2 with the error (the handler gets ``(args, config)``)."""
    def run(args: argparse.Namespace) -> int:
        try:
            config = config_from_args(args)
        except ValueError as exc:
            return fail(command, str(exc))
        return handler(args, config)
    return run


def dir_command(command: str, handler: Handler) -> Callable[[argparse.Namespace], int]:
    """Wrap a handler: resolve and open DIR, turning a non-cache path or bad value into exit 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            if args.dir:
                path, origin = Path(args.dir), "DIR"
            else:
                config = config_from_args(args)
                path, origin = config.ssd_dir, f"ssd_dir, from {config.sources['ssd_dir']}"
            if not os.path.lexists(path):
                return fail(command, f"{path} ({origin}) does not exist yet: a server creates its "
                                     "cache directory when it starts; start one on it first "
                                     f"(`paged-cache serve --ssd-dir {path} --model MODEL`), or "
                                     "give the DIR of an existing cache")
            cache = CacheDir(path)
        except (NotACacheError, ManifestError, ValueError) as exc:
            return fail(command, str(exc))
        if cache.read_only:
            unread = cache.unread_wal_bytes
            print(f"paged-cache {command}: note: {cache.path} is read-only (a read-only mount or no "
                  "write permission): read as it is, nothing in it can be changed"
                  + (f"; the last {format_size(unread)} of manifest changes (its write-ahead log) "
                     "are not read" if unread else ""), file=sys.stderr)
        try:
            return handler(args, cache)
        except (NotACacheError, ManifestError, ValueError) as exc:
            return fail(command, str(exc))

    return run


def require_writable(cache: CacheDir, action: str) -> None:
    """ValueError (exit 2) when ``cache`` is read-only: ``action`` would have to change it."""
    if cache.read_only:
        raise ValueError(f"{cache.path} is read-only (a read-only mount or no write permission): "
                         f"cannot {action}")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(title: str | None, columns: list[str], rows: list[list[Any]], *,
          right: tuple[str, ...] = (), header: bool = True, optional: tuple[str, ...] = (),
          width: int | None = None, caption: str | Callable[[list[str]], str] | None = None,
          section_ends: frozenset[int] = frozenset()) -> Table:
    """A rich table that fits ``width`` (the console's) without truncating a number.

    Columns named in ``right`` (numbers) are right-aligned and never shrink; the others wrap.
    When the table cannot fit, the columns in ``optional`` are dropped in that order (a callable
    ``caption`` is given the columns kept, so it explains only those). A line follows each row
    whose index is in ``section_ends``.
    """
    width = console().width if width is None else width
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    keep = list(columns)

    def need(name: str) -> int:  # unwrapped width (a header may wrap at its spaces)
        i = columns.index(name)
        heading = max(map(len, name.split())) if header and name else 0
        return max([len(r[i]) for r in cells] + [heading])

    for name in optional:
        if sum(map(need, keep)) + 3 * (len(keep) - 1) <= width:
            break
        keep.remove(name)
    caption = caption(keep) if callable(caption) else caption
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, show_header=header,
              caption=caption, caption_justify="left")
    for name in keep:
        if name in right:
            t.add_column(name, justify="right", no_wrap=True, min_width=need(name))
        else:
            t.add_column(name, justify="left", overflow="fold")
    for i, row in enumerate(cells):
        t.add_row(*(v for name, v in zip(columns, row) if name in keep),
                  end_section=i in section_ends)
    return t


def size(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_size(int(nbytes))


def duration(seconds: float | None) -> str:
    """A time span in the unit that reads best: '850 us', '15.1 ms', '2.35 s', '3m 05s', '2.1h'."""
    if seconds is None:
        return "-"
    def three(x: float) -> str:  # three significant digits, never an exponent
        return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"

    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{three(seconds * 1e3)} ms"
    if seconds < 60:
        return f"{three(seconds)} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"
    return f"{seconds / 3600:.1f}h"


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


class StoredModel(NamedTuple):
    """What a model's blocks say of it, for people: its name as served and, for a model split
    over several ranks, the rank's shard (e.g. "rank 1/2 layers 0-2")."""

    name: str = ""
    shard: str = ""


def stored_models(cache: CacheDir, rows: Iterable[Row]) -> dict[str, StoredModel]:
    """{fingerprint: StoredModel}, from one readable block header per fingerprint (blocks
    written without a name or shard give "")."""
    models: dict[str, StoredModel] = {}
    for row in rows:
        if not row.fingerprint or row.fingerprint in models or row.state != COMPLETE:
            continue
        files = cache.files_of(row.key)
        try:
            meta = read_header(files[0]).meta if files else None
        except (OSError, ValueError):
            meta = None
        if meta is not None:
            models[row.fingerprint] = StoredModel(meta.get(fmt.META_MODEL_NAME, ""),
                                                  meta.get(fmt.META_SHARD, ""))
    return models


def model_name(fingerprint: str | None, models: dict[str, StoredModel]) -> str:
    """A model's name for people: the last part of its stored name (a directory's name, a repo's
    model name) and its shard if any, e.g. "tiny rank 0/2 tensor" ("" when blocks carry none)."""
    model = models.get(fingerprint or "", StoredModel())
    name = os.path.basename(model.name.rstrip("/\\"))
    return " ".join(p for p in (name, model.shard) if p)


def model_label(fingerprint: str | None, models: dict[str, StoredModel]) -> str:
    """A model for a table: its name (model_name) and short fingerprint, e.g. "tiny rank 0/2
    tensor 1a2b3c4d5e6f"."""
    return " ".join(p for p in (model_name(fingerprint, models), short(fingerprint)) if p)


def model_json(fingerprint: str | None, models: dict[str, StoredModel]) -> dict[str, str]:
    """The name and shard fields of a model in --json output."""
    model = models.get(fingerprint or "", StoredModel())
    return {"name": model.name, "shard": model.shard}


def iso(when: float | None) -> str | None:
    return None if when is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))
