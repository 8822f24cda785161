"""Start mlx_lm.server (OpenAI-compatible HTTP API) with paged-cache's tiered block cache in
place of its in-memory LRUPromptCache. Options not listed here (--host, --port, --max-tokens,
--prompt-cache-bytes, ...) are passed to mlx_lm.server unchanged; see `mlx_lm.server --help`.
--log-level is both paged-cache's and mlx_lm.server's."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from paged_cache.cli.options import add_config_arguments
from paged_cache.cli.render import config_command, fail
from paged_cache.config import CacheConfig

SERVER_LOG_DEFAULT = "INFO"   # mlx_lm.server's own --log-level default
MAX_PORT = 65535


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the serve subcommand (unknown options are passed to mlx_lm.server)."""
    parser = subparsers.add_parser(
        "serve", help="run mlx_lm.server with the tiered (RAM, SSD, remote) prompt cache",
        description=__doc__)
    parser.add_argument("--model", required=True,
                        help="mlx-lm model directory or Hugging Face repo (as mlx_lm.server)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="also answer /metrics and /paged-cache/stats on --host at PORT + "
                             "rank, in every process (each rank of a model sharded with "
                             "mlx.launch); default: on the serving port only, rank 0 alone")
    add_config_arguments(parser)
    parser.set_defaults(func=config_command("serve", run), accepts_extra_args=True,
                        log_level=SERVER_LOG_DEFAULT)


def check_server_options(serve: argparse.ArgumentParser, server_argv: list[str]) -> None:
    """Check the options passed through with mlx_lm.server's own parser, before anything
    starts: an option neither takes, a bad value of one of mlx_lm.server's options or a port
    outside 1-65535 exits (status 2) with `paged-cache serve`'s usage, which lists paged-cache's
    flags, instead of mlx_lm.server's, which lists none of them."""
    from paged_cache import compat

    server = compat.server_parser()
    server.prog = serve.prog
    server.error = serve.error  # type: ignore[method-assign]  # its value errors, our usage
    known, unknown = server.parse_known_args(server_argv)
    if unknown:
        serve.error(f"unrecognized arguments: {' '.join(unknown)} (neither a paged-cache flag "
                    "above nor an option of `mlx_lm.server --help`)")
    port = getattr(known, "port", None)
    if isinstance(port, int) and not 1 <= port <= MAX_PORT:
        serve.error(f"--port: expected a TCP port in 1-{MAX_PORT}, got {port}")


def _model_error(model: str) -> str | None:
    """Why ``--model`` cannot be served, for a local path (a Hugging Face repo id is left to
    mlx_lm, which loads the model only when the server starts)."""
    local = os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model)
    path = os.path.expanduser(model)
    if not local:
        return None
    if not os.path.isdir(path):
        return f"--model: {model!r} is not a directory (expected an mlx-lm model directory or a " \
               "Hugging Face repo id)"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model: {model!r} has no config.json (expected an mlx-lm model directory)"
    return None


def check_metrics_port(args: argparse.Namespace) -> None:
    """``--metrics-port`` is a TCP port (or absent), else the command's usage error."""
    if args.metrics_port is not None and not 1 <= args.metrics_port <= MAX_PORT:
        args.command_parser.error(f"--metrics-port: expected a TCP port in 1-{MAX_PORT}, got "
                                  f"{args.metrics_port}")


def run(args: argparse.Namespace, config: CacheConfig) -> int:
    """Run the server with the cache ``config`` until stopped."""
    if (problem := _model_error(args.model)) is not None:
        return fail("serve", problem)
    model = os.path.expanduser(args.model) if args.model.startswith("~") else args.model
    server_argv = ["--model", model, "--log-level", args.log_level, *args.extra_args]
    check_server_options(args.command_parser, server_argv)
    check_metrics_port(args)
    # mlx_lm.server's logging.basicConfig is a no-op once ours ran: apply its level here (the
    # paged_cache loggers have it already, cli.main).
    logging.getLogger().setLevel(args.log_level)
    from paged_cache.integrations.mlx_lm import ServeError, serve_main

    try:
        status = serve_main(config, server_argv, args.metrics_port)
    except ServeError as error:
        status = fail("serve", str(error), 1)
    # The manager is closed (every block written). Skip interpreter finalization: there, MLX's
    # threads of the stopped server abort the process about half the time (std::terminate, plain
    # mlx_lm.server too), which would turn a clean stop into exit status -6.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
