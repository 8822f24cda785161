"""Resolve default < --config TOML < PAGED_CACHE_* env < flags and print it."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from paged_cache.cli import render
from paged_cache.cli.options import HIDDEN_FIELDS, add_config_arguments
from paged_cache.cli.render import config_command
from paged_cache.config import CacheConfig, format_size


def register(subparsers: Any) -> None:
    """Add the `config` subcommand."""
    parser = subparsers.add_parser(
        "config", help="show the effective cache configuration and each value's source",
        description=__doc__)
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=config_command("config", run))


def _describe(config: CacheConfig) -> dict[str, Any]:
    """{field: {value, source, active[, human]}} including the resolved SSD budget; with
    hot_cache_only the SSD fields are inactive (kept with their source, not used). A setting for
    tests (``HIDDEN_FIELDS``) is shown only where something set it."""
    out: dict[str, Any] = {}
    inactive = config.inactive_fields()
    for name, value in config.to_dict().items():
        if name in HIDDEN_FIELDS and config.sources[name] == "default":
            continue
        entry: dict[str, Any] = {"value": value, "source": config.sources[name],
                                 "active": name not in inactive}
        if name.endswith("_bytes") and isinstance(value, int):
            entry["human"] = format_size(value)
        out[name] = entry
    if not config.hot_cache_only:
        budget = config.ssd_budget_bytes()
        out["ssd_max_bytes"]["effective_bytes"] = budget
        out["ssd_max_bytes"]["effective_human"] = format_size(budget)
    return out


def run(args: argparse.Namespace, config: CacheConfig) -> int:
    """Print the configuration (an invalid one: exit status 2, ``config_command``)."""
    described = _describe(config)
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    width = max(map(len, config.to_dict()))  # the same columns whether a hidden one shows or not
    # a terminal's width (or $COLUMNS); piped, one line per setting (for grep)
    columns = render.console().width if render.sized_output() else sys.maxsize
    for name, entry in described.items():
        value = entry["value"]
        if "human" in entry:
            value = f"{value} ({entry['human']})"
        if "effective_human" in entry:
            value = f"{value} (now {entry['effective_human']})"
        inactive = "" if entry["active"] else "  (inactive: hot_cache_only)"
        # one line per setting; past the width its words go on indented lines
        print(textwrap.fill(f"{value}  [{entry['source']}]{inactive}", columns,
                            initial_indent=f"{name:<{width}}  ", subsequent_indent=" " * (width + 2),
                            break_on_hyphens=False))
    return 0
