"""`paged-cache vllm-mlx ...`, `paged-cache openai-server ...`, `paged-cache exo ...`: another
serving engine's own command line, with paged-cache as its prompt cache (the engine's options pass
through)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from typing import Callable

from paged_cache.cli.options import add_config_arguments, config_from_args
from paged_cache.cli.render import fail

# subcommand -> (the engine's own command, module holding serve_main, help)
ENGINES: dict[str, tuple[str, str, str]] = {
    "vllm-mlx": ("vllm-mlx serve MODEL --continuous-batching [options]",
                 "paged_cache.integrations.vllm_mlx.adapter",
                 "run vllm-mlx with paged-cache as the prefix cache of its batching scheduler"),
    "openai-server": ("mlx-openai-server launch --model-path MODEL [options]",
                      "paged_cache.integrations.openai_server.adapter",
                      "run mlx-openai-server with paged-cache as its language models' prompt cache"),
    "exo": ("exo [options]",
            "paged_cache.integrations.exo.launcher",
            "run exo with paged-cache as the prefix cache of every runner it starts"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """One subcommand per engine; options paged-cache does not know go to the engine."""
    for name, (usage, _, help_text) in ENGINES.items():
        parser = subparsers.add_parser(
            name, help=help_text,
            description=f"{help_text}. Everything that is not an option below is the "
                        f"engine's own command line, as in `{usage}` (--log-level here is "
                        "paged-cache's: the level of its loggers).")
        if name == "exo":
            parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                                help="each runner (one per model and rank) answers /metrics "
                                     "and /paged-cache/stats on 127.0.0.1 at PORT + its rank")
        add_config_arguments(parser)
        parser.set_defaults(func=_runner(name), accepts_extra_args=True, log_level="INFO")


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _runner(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            config = config_from_args(args)
        except ValueError as error:
            return fail(name, str(error))
        from paged_cache.cli.serve import check_metrics_port
        from paged_cache.compat import IncompatibleVersion

        ports = {}
        if "metrics_port" in args:
            check_metrics_port(args)
            ports["metrics_port"] = args.metrics_port

        try:
            module = importlib.import_module(ENGINES[name][1])
        except IncompatibleVersion as error:
            return fail(name, str(error), 1)
        previous = signal.signal(signal.SIGTERM, _interrupt)   # stop like Ctrl-C
        try:
            status = module.serve_main(config, args.extra_args, **ports)
        except KeyboardInterrupt:
            status = 0
        except module.ServeError as error:
            status = fail(name, str(error), 1)
        finally:
            signal.signal(signal.SIGTERM, previous)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # The manager is closed (every block written); skip interpreter finalization, where the
        # engine's stopped MLX threads can abort the process.
        os._exit(status)

    return run
