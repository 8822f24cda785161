"""`paged-cache make-model DIR --arch ARCH`: write a tiny random-weight mlx-lm model directory."""

from __future__ import annotations

import argparse
import sys

from paged_cache.testing.model_dir import (DTYPES, SIZE_KEYS, TOKENIZER_VOCAB_SIZE,
                                           write_model_dir)
from paged_cache.testing.models import ARCHS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the make-model subcommand."""
    parser = subparsers.add_parser(
        "make-model", help="write a tiny offline mlx-lm model directory (random weights)",
        description="Write config.json, model.safetensors (random weights) and a byte-level "
                    f"tokenizer ({TOKENIZER_VOCAB_SIZE} tokens, ChatML chat template) to DIR; "
                    "mlx_lm.load(DIR) loads it with no network. Generated text is meaningless.")
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--arch", default="llama", choices=ARCHS, metavar="ARCH",
                        help=f"architecture: {', '.join(ARCHS)} (default llama)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weight dtype (default float32)")
    parser.add_argument("--seed", type=int, default=0, help="random weight seed (default 0)")
    for name, key in SIZE_KEYS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                            help=f"sets {key} (default: the arch's tiny config)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the directory and print its path."""
    sizes = {name: getattr(args, name) for name in SIZE_KEYS}
    try:
        path = write_model_dir(args.dir, args.arch, seed=args.seed, dtype=args.dtype, **sizes)
    except ValueError as error:
        print(f"paged-cache make-model: error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0
