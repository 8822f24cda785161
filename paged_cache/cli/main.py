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
from typing import Sequence

EXIT_BROKEN_PIPE = 128 + 13   # what a shell reports for a process SIGPIPE ended

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
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="paged-cache",
                                     description="Tiered KV cache for MLX serving engines.")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="level of the paged_cache logger (default WARNING)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for command in subparsers.choices.values():
        # A subcommand's own parser: its usage (and flags) is what a typo in its options shows.
        command.set_defaults(command_parser=command)
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
