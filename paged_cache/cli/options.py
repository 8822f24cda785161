"""The one shared set of CacheConfig flags for every `paged-cache` subcommand (and engines).

`add_config_arguments(parser)` adds ``--config FILE`` and one flag per CacheConfig field;
`config_from_args(args)` layers default < TOML (--config) < PAGED_CACHE_* env < flags.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

from paged_cache.config import (ENV_PREFIX, FETCH_POLICIES, QUEUE_FULL_POLICIES, SSD_ADMISSIONS,
                                WRITE_POLICIES, CacheConfig)
from paged_cache.tiers.format import COMPRESSIONS

_CHOICES = {"compression": COMPRESSIONS, "write_policy": WRITE_POLICIES,
            "ssd_admission": SSD_ADMISSIONS, "queue_full_policy": QUEUE_FULL_POLICIES,
            "fetch_policy": FETCH_POLICIES}
_METAVARS = {"block_size": "TOKENS", "hot_cache_max_bytes": "SIZE", "ssd_dir": "DIR",
             "ssd_max_bytes": "SIZE|auto", "write_queue_max_bytes": "SIZE",
             "remote_url": "URL", "remote_ttl": "SECONDS", "remote_timeout": "SECONDS",
             "remote_queue_max_bytes": "SIZE", "ssd_read_threads": "N",
             "remote_tls_ca": "FILE", "remote_tls_cert": "FILE", "remote_tls_key": "FILE",
             "prefill_tokens_per_s": "RATE", "test_ssd_read_bytes_per_s": "RATE"}
BOOL_FIELDS = ("hot_cache_only", "remote_cluster", "remote_insecure", "cache_salt_from_user",
               "fetch_overlap", "shared_prefill")
# Fields no flag sets: other users can read a process's command line (ps, /proc), so a secret
# comes from the environment or a private TOML file; the flag is refused, saying so.
NO_FLAG_FIELDS = ("remote_secret",)
# Fields for tests and demonstrations: their flags are taken but left out of --help.
HIDDEN_FIELDS = ("test_ssd_read_bytes_per_s",)


def flag_of(name: str) -> str:
    """The command-line flag of a CacheConfig field: block_size -> --block-size."""
    return "--" + name.replace("_", "-")


class _Refused(argparse.Action):
    """A flag of a NO_FLAG_FIELDS field: a usage error naming where the value goes instead."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: not taken on the command line, where other users can read "
                     f"it (ps); set {ENV_PREFIX}{self.dest.upper()} or {self.dest} in a private "
                     "--config TOML file")


def add_config_arguments(parser: argparse.ArgumentParser,
                         fields: tuple[str, ...] | None = None) -> None:
    """Add --config FILE and a flag per CacheConfig field in ``fields`` (default: every field; a
    command lists only the fields it uses). Every flag defaults to "not given"; the flag of a
    NO_FLAG_FIELDS field is hidden and refused, that of a HIDDEN_FIELDS one hidden."""
    group = parser.add_argument_group("cache configuration",
                                      "precedence: default < --config TOML < PAGED_CACHE_* env < flags")
    group.add_argument("--config", dest="config_file", metavar="FILE", default=None,
                       help="TOML file with a [paged_cache] table (or settings at top level)")
    for name in fields or CacheConfig.field_names():
        help_text = argparse.SUPPRESS if name in HIDDEN_FIELDS else CacheConfig.field_help(name)
        if name in NO_FLAG_FIELDS:
            group.add_argument(flag_of(name), dest=name, action=_Refused, default=None,
                               help=argparse.SUPPRESS)
        elif name in BOOL_FIELDS:
            group.add_argument(flag_of(name), dest=name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag_of(name), dest=name, default=None, help=help_text,
                               choices=_CHOICES.get(name), metavar=_METAVARS.get(name))


def config_from_args(args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> CacheConfig:
    """The effective CacheConfig of parsed args; ``config.sources`` says where each value came from.

    Raises ValueError (naming the field and the accepted form) on any invalid value.
    """
    flags = {name: getattr(args, name) for name in CacheConfig.field_names()
             if getattr(args, name, None) is not None}
    return CacheConfig.layered(toml_path=getattr(args, "config_file", None),
                               environ=os.environ if environ is None else environ,
                               overrides=flags,
                               override_source={name: f"flag:{flag_of(name)}" for name in flags})
