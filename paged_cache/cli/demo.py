"""Run several chat conversations that share a system prompt through the Scheduler with the
tiered cache, restart the cache manager between two phases (so SSD hits show), and compare every
turn with a cold prefill. Prints a table per turn and a summary; writes demo.png and
demo-results.json. The embedded model has random weights: its text is meaningless, the cache
mechanics are real."""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_cache.cli.options import add_config_arguments
from paged_cache.cli.render import config_command, fail
from paged_cache.config import CacheConfig

DEFAULT_OUTPUT = Path("demo-output")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the demo subcommand."""
    parser = subparsers.add_parser(
        "demo", help="run the multi-turn chat demo (tiny embedded model, TTFT and memory per turn)",
        description=__doc__)
    parser.add_argument("--model", type=Path, default=None,
                        help="an mlx-lm model directory to use instead of the embedded tiny model")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="where the embedded model, the SSD tier (unless --ssd-dir), the plot "
                             "and the results go (default ./demo-output)")
    parser.add_argument("--short", action="store_true",
                        help="a few short turns (CI smoke run)")
    add_config_arguments(parser)
    parser.set_defaults(func=config_command("demo", run))


def run(args: argparse.Namespace, config: CacheConfig) -> int:
    """Run the demo with the cache ``config``; exit status 2 on a bad option."""
    if args.model is not None and not (args.model / "config.json").is_file():
        return fail("demo", f"--model: {args.model} is not an mlx-lm model directory "
                            "(no config.json)")
    from paged_cache.cli.demo_workload import run_demo

    run_demo(config, output=args.output, model_dir=args.model, short=args.short)
    return 0
