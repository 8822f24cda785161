"""The `paged-cache` command: one subcommand per module in COMMAND_MODULES.

Each module defines ``register(subparsers) -> None``, adding its subparser(s) with
``set_defaults(func=handler)``; a handler takes the parsed args and returns an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from importlib import metadata
from typing import Sequence

EXIT_BROKEN_PIPE = 128 + 13   # what a shell reports for a process SIGPIPE ended
DIST = "paged-cache"          # the distribution whose metadata gives --version
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_DEFAULT = "WARNING"  # a subcommand may set its own (serving commands: INFO)

COMMAND_MODULES: list[str] = [
    # appended by the modules that add subcommands, e.g. "paged_cache.cli.config_cmd"
    "paged_cache.cli.make_model",
    "paged_cache.cli.serve",
    "paged_cache.cli.engines",
    "paged_cache.cli.demo",
    "paged_cache.cli.config_cmd",
    "paged_cache.cli.inspect_cmd",
    "paged_cache.cli.verify_cmd",
    "paged_cache.cli.prune_cmd",
    "paged_cache.cli.stats_cmd",
    "paged_cache.cli.prompt_diff",
]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with a usage that fits the width: where argparse's wrapped usage runs
    past it (a group of flags it cannot break), ``prog [options] POSITIONALS`` instead (the
    options are listed below it)."""

    def _format_usage(self, usage, actions, groups, prefix):  # type: ignore[no-untyped-def]
        text = super()._format_usage(usage, actions, groups, prefix)
        if usage is not None or max(map(len, text.splitlines())) <= self._width:
            return text
        positionals = self._format_actions_usage([a for a in actions if not a.option_strings], [])
        return super()._format_usage(f"%(prog)s [options] {positionals}".rstrip(), actions,
                                     groups, prefix)


def version() -> str:
    """paged-cache's version, from the installed package's metadata."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return "unknown (the package is not installed: run `pip install -e .` in its clone)"


def _add_log_level(command: argparse.ArgumentParser) -> None:
    """The one --log-level flag, on every subcommand: the level of the paged_cache loggers (and,
    for serve, of mlx_lm.server's). A subcommand's own default comes from its set_defaults."""
    default = command.get_default("log_level") or LOG_LEVEL_DEFAULT
    command.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                         metavar="LEVEL", help=f"log level: {', '.join(LOG_LEVELS)} (default "
                                               f"{default})")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="paged-cache", formatter_class=HelpFormatter,
                                     description="Tiered KV cache for MLX serving engines.",
                                     epilog="`paged-cache COMMAND --help` lists a command's "
                                            "options (--log-level included).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for command in subparsers.choices.values():
        # A subcommand's own parser: its usage (and flags) is what a typo in its options shows.
        command.set_defaults(command_parser=command)
        command.formatter_class = HelpFormatter
        _add_log_level(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra_args", False):
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra   # passed through by subcommands that set accepts_extra_args
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("paged_cache").setLevel(args.log_level)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`paged-cache ls --json | head -1`): stop quietly, as a tool
        # killed by SIGPIPE does, and send what is still buffered nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
