"""CacheConfig: the storage settings, their defaults, size parsing, and the env / TOML sources.

Values come from (lowest to highest precedence) built-in defaults, a TOML file, ``PAGED_CACHE_*``
environment variables and command-line flags; `CacheConfig.layered` merges them and records where
each effective value came from (shown by ``paged-cache config``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tomllib
import urllib.parse
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from decimal import Decimal
from typing import Any, Mapping

from paged_cache.remote_settings import (SECRET_MIN_CHARS, TLS_SCHEMES, RemoteURL, Secret,
                                          is_loopback, parse_remote_url, parse_secret)
from paged_cache.tiers.format import COMPRESSIONS

log = logging.getLogger("paged_cache.config")

ENV_PREFIX = "PAGED_CACHE_"
TOML_TABLE = "paged_cache"

WRITE_POLICIES = ("write-through", "write-back")
SSD_ADMISSIONS = ("all", "reused")
QUEUE_FULL_POLICIES = ("skip", "write-on-caller")
FETCH_POLICIES = ("cost", "always-restore", "always-prefill")

# Decimal units are powers of 1000, binary (…iB) powers of 1024; matched case-insensitively.
SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_FORM = "a non-negative int of bytes or a string like '512MB', '8GB', '1.5GiB' " \
            "(B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024)"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

HOT_RAM_SHARE = 0.25          # default hot budget: a quarter of physical RAM ...
HOT_DEFAULT_CAP = 8 * 2**30   # ... capped at 8 GiB
HOT_FALLBACK = 2 * 2**30      # when physical RAM cannot be read
SSD_AUTO_SHARE = 0.5          # ssd_max_bytes="auto": half of (free space + the cache's own bytes)
QUEUE_DEFAULT = 256 * 2**20   # write queue: 256 MiB of raw block buffers
REMOTE_QUEUE_DEFAULT = 64 * 2**20   # remote write queue: 64 MiB of raw block buffers
REMOTE_TIMEOUT_DEFAULT = 0.5        # seconds a remote read or write may wait on one socket operation
# Read by the remote tier at connect time, never stored in a CacheConfig (nor shown by `config`).
REMOTE_PASSWORD_ENV = "PAGED_CACHE_REMOTE_PASSWORD"
READ_THREADS_DEFAULT = 4      # block files read at once by a fetch (measured: docs/benchmarks.md)
TAIL_WRITE_DELAY_DEFAULT = 10.0 # seconds a partial tail waits for its superseding store (docs)
# shared_prefill: a request held back for another's prefill goes on without it after this long
SHARED_PREFILL_MAX_WAIT_S = 60.0
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class _Unset:
    """Marker for a field the caller did not give (so the default applies and it is not explicit)."""

    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a size string ('512MB', '1.5GiB'); ValueError names `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name}: expected {SIZE_FORM}, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value or value == float("inf"):
            raise ValueError(f"{name}: expected {SIZE_FORM}, got {value!r}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name}: expected a whole number of bytes, got {value!r}")
        return int(value)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(f"{name}: expected {SIZE_FORM}, got {value!r}")
    return int(Decimal(match.group(1)) * SIZE_UNITS[unit])


def format_size(nbytes: int) -> str:
    """Human-readable binary size, e.g. 1610612736 -> '1.5 GiB'."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.4g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_bool(value: Any, name: str) -> bool:
    """A bool from a bool or one of 1/0, true/false, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError(f"{name}: expected a bool (true/false, 1/0, yes/no, on/off), got {value!r}")


def physical_memory_bytes() -> int | None:
    """Installed RAM from sysconf, or None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_hot_cache_max_bytes() -> int:
    """A quarter of physical RAM, at most 8 GiB (2 GiB when RAM is unknown)."""
    ram = physical_memory_bytes()
    return HOT_FALLBACK if not ram else min(int(ram * HOT_RAM_SHARE), HOT_DEFAULT_CAP)


def default_ssd_dir() -> Path:
    """$XDG_CACHE_HOME/paged-cache, else ~/.cache/paged-cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paged-cache"


def filesystem_space(path: Path) -> tuple[int, int]:
    """(total, free) bytes of the filesystem that holds `path` (or would: its nearest existing
    ancestor, so nothing is created)."""
    probe = path.absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return usage.total, usage.free


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value.strip().lower()


def _block_size(value: Any, name: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int (tokens per block), got {value!r}")
    return value


def _read_threads(value: Any, name: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ValueError(f"{name}: expected an int in [1, 64] (block files read at once), got {value!r}")
    return value


def _rate(value: Any, name: str) -> float:
    """A rate (per second) >= 0 from a number or its text; 0 means none."""
    return _non_negative(value, name, "a number >= 0 (per second)")


def _path(value: Any, name: str) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: expected a directory path, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{name}: {value!r} contains a NUL byte, which no path can hold")
    return Path(os.path.expanduser(value))


def _optional_path(value: Any, name: str) -> Path | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return _path(value, name)


def _seconds(value: Any, name: str) -> float:
    return _non_negative(value, name, "seconds (a number >= 0)")


def _non_negative(value: Any, name: str, form: str) -> float:
    """A finite float >= 0 from a number or its text; ValueError naming ``form`` otherwise."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{name}: expected {form}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name}: expected {form}, got {value!r}")
    return float(value)


def _positive_seconds(value: Any, name: str) -> float:
    seconds = _seconds(value, name)
    if seconds <= 0:
        raise ValueError(f"{name}: expected seconds > 0, got {value!r}")
    return seconds


def _size_or_auto(value: Any, name: str) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_size(value, name)


# name -> (parser(value, name) -> normalized, help text). Order = display order.
_FIELD_SPECS: dict[str, tuple[Any, str]] = {
    "block_size": (_block_size, "tokens per block (positive int; default 256)"),
    "hot_cache_max_bytes": (parse_size,
                            "RAM budget of the hot tier (size; default 1/4 of RAM, at most 8 GiB)"),
    "ssd_dir": (_path, "directory of the SSD tier (default ($XDG_CACHE_HOME or ~/.cache)/paged-cache)"),
    "ssd_max_bytes": (_size_or_auto,
                      "SSD budget (size or 'auto' = half of free space plus the cache's own bytes)"),
    "hot_cache_only": (parse_bool, "keep blocks in RAM only: no directory, no files, no writer thread"),
    "compression": (lambda v, n: _choice(v, n, COMPRESSIONS), "block file compression: none | lz4"),
    "write_policy": (lambda v, n: _choice(v, n, WRITE_POLICIES),
                     "write-through (queue every put for SSD; default) | write-back (on eviction/close)"),
    "ssd_admission": (lambda v, n: _choice(v, n, SSD_ADMISSIONS),
                      "which blocks reach the SSD: all (default) | reused (only blocks read again "
                      "after their put; the others live in RAM only)"),
    "tail_write_delay_s": (_seconds, "seconds a partial tail (a conversation's last tokens, fewer "
                                     "than a block) waits in RAM for the store that supersedes "
                                     "it before it is written to SSD anyway (0 = at once; "
                                     f"default {TAIL_WRITE_DELAY_DEFAULT:g})"),
    "write_queue_max_bytes": (parse_size, "byte bound of the SSD write queue (default 256 MiB)"),
    "queue_full_policy": (lambda v, n: _choice(v, n, QUEUE_FULL_POLICIES),
                          "when the write queue is full: skip (drop the write, count it; default) | "
                          "write-on-caller (write synchronously)"),
    "remote_url": (parse_remote_url, "shared remote tier below SSD on a Valkey / Redis server, e.g. "
                                "redis://host:6379/0 (rediss:// for TLS; password in the URL or "
                                f"{REMOTE_PASSWORD_ENV}); default none"),
    "remote_cluster": (parse_bool, "remote_url names a node of a Valkey / Redis Cluster: keys "
                                   "go to their shards by hash slot (default false)"),
    "remote_ttl": (_seconds, "seconds a block lives on the remote server after its last write "
                             "or lookup (0 = no TTL: the server's maxmemory policy evicts; "
                             "default 0)"),
    "remote_timeout": (_positive_seconds, "seconds one remote socket operation may wait before the "
                                          "tier counts an error and serves locally (default 0.5)"),
    "remote_queue_max_bytes": (parse_size, "byte bound of the remote write queue (default 64 MiB)"),
    "remote_secret": (parse_secret, "key of the MAC every remote value carries: values without a valid "
                               f"one are refused (at least {SECRET_MIN_CHARS} characters; never "
                               f"shown; give it by environment, {ENV_PREFIX}REMOTE_SECRET); "
                               "required for a remote_url off loopback unless remote_insecure"),
    "remote_insecure": (parse_bool, "allow a remote_url off loopback without remote_secret "
                                    "(anyone who can write to the server can then change what "
                                    "every host serves; a WARNING each time a manager starts; "
                                    "default false)"),
    "remote_tls_ca": (_optional_path, "CA certificates (PEM) that verify a rediss:// server "
                                      "(default: the system's)"),
    "remote_tls_cert": (_optional_path, "client certificate (PEM) for a rediss:// server that "
                                        "asks for one (with remote_tls_key)"),
    "remote_tls_key": (_optional_path, "private key (PEM) of remote_tls_cert"),
    "cache_salt_from_user": (parse_bool, "serve, vllm-mlx, openai-server: a request's OpenAI "
                                         "`user` field is its cache salt when it names none "
                                         "(tenants never share a prefix; default false)"),
    "ssd_read_threads": (_read_threads, "block files a fetch reads from SSD at once (default 4)"),
    "fetch_policy": (lambda v, n: _choice(v, n, FETCH_POLICIES),
                     "restore or prefill a stored prefix: cost (the faster by measured rates; "
                     "default) | always-restore | always-prefill"),
    "fetch_overlap": (parse_bool, "under fetch_policy cost, prefill the head of a stored prefix "
                                  "while the rest is read from SSD when that is predicted faster "
                                  "than either alone (default true)"),
    "shared_prefill": (parse_bool, "serve, vllm-mlx, openai-server: a request sharing a prefix "
                                   "(e.g. a system prompt) with one being prefilled waits for it "
                                   "(until its prefix is stored or its first token is out, at "
                                   f"most {SHARED_PREFILL_MAX_WAIT_S:g} s) and restores the "
                                   "prefix instead of prefilling it again (default true)"),
    "prefill_tokens_per_s": (_rate, "the model's prefill rate (tokens/s) the fetch plan assumes "
                                    "until it has measured or saved one (0 = none: restore until "
                                    "measured; default 0)"),
    "test_ssd_read_bytes_per_s": (parse_size, "for tests and demonstrations only: SSD reads "
                                              "take as long as at this many bytes/s (size; 0 = "
                                              "off; default 0)"),
}

_DEFAULTS: dict[str, Any] = {
    "block_size": 256,
    "hot_cache_max_bytes": default_hot_cache_max_bytes,
    "ssd_dir": default_ssd_dir,
    "ssd_max_bytes": "auto",
    "hot_cache_only": False,
    "compression": "none",
    "write_policy": "write-through",
    "ssd_admission": "all",
    "tail_write_delay_s": TAIL_WRITE_DELAY_DEFAULT,
    "write_queue_max_bytes": QUEUE_DEFAULT,
    "queue_full_policy": "skip",
    "remote_url": None,
    "remote_cluster": False,
    "remote_ttl": 0.0,
    "remote_timeout": REMOTE_TIMEOUT_DEFAULT,
    "remote_queue_max_bytes": REMOTE_QUEUE_DEFAULT,
    "remote_secret": None,
    "remote_insecure": False,
    "remote_tls_ca": None,
    "remote_tls_cert": None,
    "remote_tls_key": None,
    "cache_salt_from_user": False,
    "ssd_read_threads": READ_THREADS_DEFAULT,
    "fetch_policy": "cost",
    "fetch_overlap": True,
    "shared_prefill": True,
    "prefill_tokens_per_s": 0.0,
    "test_ssd_read_bytes_per_s": 0,
}

# Settings that only mean something with an SSD tier: hot_cache_only makes them inert, whatever
# their source (they are kept, logged once and shown as inactive by `paged-cache config`).
SSD_FIELDS = ("ssd_dir", "ssd_max_bytes", "compression", "write_policy", "ssd_admission",
              "tail_write_delay_s", "write_queue_max_bytes", "queue_full_policy",
              "ssd_read_threads", "test_ssd_read_bytes_per_s")
_logged_inert: set[tuple] = set()


@dataclass(frozen=True)
class CacheConfig:
    """Storage settings of a PagedSSDCacheManager; normalized and validated on construction.

    Omitted fields take their defaults (see docs/configuration.md). Sizes accept ints or strings
    such as "512MB" / "1.5GiB"; ``ssd_max_bytes`` also accepts "auto". ``hot_cache_only`` is a
    master switch: with it the SSD fields (``SSD_FIELDS``) are inert, not errors.
    """

    block_size: int = UNSET
    hot_cache_max_bytes: int = UNSET
    ssd_dir: Path = UNSET
    ssd_max_bytes: int | str = UNSET
    hot_cache_only: bool = UNSET
    compression: str = UNSET
    write_policy: str = UNSET
    ssd_admission: str = UNSET
    tail_write_delay_s: float = UNSET
    write_queue_max_bytes: int = UNSET
    queue_full_policy: str = UNSET
    remote_url: RemoteURL | None = UNSET
    remote_cluster: bool = UNSET
    remote_ttl: float = UNSET
    remote_timeout: float = UNSET
    remote_queue_max_bytes: int = UNSET
    remote_secret: Secret | None = UNSET
    remote_insecure: bool = UNSET
    remote_tls_ca: Path | None = UNSET
    remote_tls_cert: Path | None = UNSET
    remote_tls_key: Path | None = UNSET
    cache_salt_from_user: bool = UNSET
    ssd_read_threads: int = UNSET
    fetch_policy: str = UNSET
    fetch_overlap: bool = UNSET
    shared_prefill: bool = UNSET
    prefill_tokens_per_s: float = UNSET
    test_ssd_read_bytes_per_s: int = UNSET
    origin: InitVar[Mapping[str, str] | None] = None
    explicit: frozenset = field(init=False, repr=False, compare=False)
    sources: dict = field(init=False, repr=False, compare=False)
    given: dict = field(init=False, repr=False, compare=False)  # sizes as written: {name: "40GB"}

    def __post_init__(self, origin: Mapping[str, str] | None) -> None:
        explicit = set()
        sources = {}
        given = {}
        for name, (parse, _) in _FIELD_SPECS.items():
            value = getattr(self, name)
            if value is UNSET:
                default = _DEFAULTS[name]
                value = default() if callable(default) else default
                sources[name] = "default"
            else:
                explicit.add(name)
                sources[name] = (origin or {}).get(name, "constructor")
                if parse in (parse_size, _size_or_auto) and isinstance(value, str):
                    given[name] = value.strip()
            try:
                object.__setattr__(self, name, parse(value, name))
            except ValueError as exc:
                raise ValueError(f"{exc} (from {sources[name]})") from None
        object.__setattr__(self, "explicit", frozenset(explicit))
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "given", given)
        self._check_consistency()

    def _size_as_given(self, name: str) -> str:
        """A size setting for a message, as it was written and in binary units ("40GB = 37.25
        GiB"; binary units alone for a default or a size given as an int)."""
        size = format_size(getattr(self, name))
        written = self.given.get(name, size)
        same = written.replace(" ", "") == size.replace(" ", "")
        return size if same else f"{written} = {size}"

    def _check_consistency(self) -> None:
        ram = physical_memory_bytes()
        if ram and self.hot_cache_max_bytes > ram:
            raise ValueError(
                f"hot_cache_max_bytes: {self._size_as_given('hot_cache_max_bytes')} (from "
                f"{self.sources['hot_cache_max_bytes']}) exceeds this machine's RAM "
                f"({format_size(ram)}): the hot tier could never stay in memory; give a size "
                f"below RAM (the default is {format_size(default_hot_cache_max_bytes())})")
        tls = [n for n in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key")
               if getattr(self, n) is not None]
        scheme = urllib.parse.urlsplit(self.remote_url or "").scheme.lower()
        if tls and scheme not in TLS_SCHEMES:
            raise ValueError(f"{tls[0]} (from {self.sources[tls[0]]}) needs a TLS remote_url "
                             f"({' or '.join(s + '://' for s in TLS_SCHEMES)}), got "
                             f"{RemoteURL(self.remote_url).redacted() if self.remote_url else None!r}")
        if (self.remote_tls_cert is None) != (self.remote_tls_key is None):
            raise ValueError("remote_tls_cert and remote_tls_key: give both (a client certificate "
                             "and its private key) or neither")
        self._check_remote_trust()
        if not self.hot_cache_only and self.ssd_max_bytes == 0:
            raise ValueError(
                f"ssd_max_bytes: 0 (from {self.sources['ssd_max_bytes']}) leaves no SSD space with "
                f"hot_cache_only=False (from {self.sources['hot_cache_only']}); give a size or "
                "'auto', or set hot_cache_only=True")

    def _check_remote_trust(self) -> None:
        """A shared tier is closed unless opened: a remote_url off loopback needs remote_secret
        (every value sealed) or the explicit opt-out remote_insecure."""
        host = urllib.parse.urlsplit(self.remote_url or "").hostname
        if not self.remote_url or self.remote_secret is not None or self.remote_insecure \
                or is_loopback(host):
            return
        raise ValueError(
            f"remote_url: {self.remote_url.redacted()!r} (from {self.sources['remote_url']}) is "
            f"another machine ({host}) and no remote_secret is set: anyone who can write to that "
            "server could change what this host serves. Give every host sharing it the same "
            f"secret of at least {SECRET_MIN_CHARS} characters, by environment: "
            f"{ENV_PREFIX}REMOTE_SECRET='...' (or remote_secret in a private TOML file); to run "
            f"without one knowingly, set remote_insecure=true ({ENV_PREFIX}REMOTE_INSECURE=1, "
            "--remote-insecure)")

    def beside_model(self, model_bytes: int, ram: int | None = None) -> "CacheConfig":
        """This configuration for a process that also holds a model of ``model_bytes`` weights,
        on a machine of ``ram`` bytes (default: physical RAM). When the hot budget and the
        weights together exceed RAM, a default hot budget is capped to what the weights leave
        (logged); an explicit one raises ValueError naming RAM, the weights and the budget."""
        ram = physical_memory_bytes() if ram is None else ram
        hot = self.hot_cache_max_bytes
        if not ram or hot + model_bytes <= ram:
            return self
        room = max(0, ram - model_bytes)
        source = self.sources["hot_cache_max_bytes"]
        if "hot_cache_max_bytes" in self.explicit:
            raise ValueError(
                f"hot_cache_max_bytes: {self._size_as_given('hot_cache_max_bytes')} (from "
                f"{source}) plus the model's weights ({format_size(model_bytes)}) exceed this "
                f"machine's RAM ({format_size(ram)}); give at most {format_size(room)}")
        log.warning("hot_cache_max_bytes: the default %s plus the model's weights (%s) exceed "
                    "RAM (%s); capping the hot tier at %s", format_size(hot),
                    format_size(model_bytes), format_size(ram), format_size(room))
        capped = dataclasses.replace(self, hot_cache_max_bytes=room)
        object.__setattr__(capped, "explicit", self.explicit)
        object.__setattr__(capped, "given", self.given)
        object.__setattr__(capped, "sources",
                           dict(self.sources, hot_cache_max_bytes=f"{source}, capped beside the "
                                                                  "model's weights"))
        return capped

    def inactive_fields(self) -> tuple[str, ...]:
        """The SSD fields hot_cache_only makes inert (compression still applies to a remote tier)."""
        if not self.hot_cache_only:
            return ()
        return tuple(n for n in SSD_FIELDS if not (n == "compression" and self.remote_url))

    def inert_fields(self) -> dict[str, str]:
        """{field: source} of the inactive fields that were given explicitly."""
        return {n: self.sources[n] for n in self.inactive_fields() if n in self.explicit}

    def log_inert_fields(self) -> None:
        """Log (once per process for the same fields and sources) which settings hot_cache_only
        overrides."""
        inert = self.inert_fields()
        key = tuple(sorted(inert.items()))
        if inert and key not in _logged_inert:
            _logged_inert.add(key)
            log.warning("hot_cache_only=True (from %s): ignoring %s", self.sources["hot_cache_only"],
                        ", ".join(f"{n} (from {src})" for n, src in inert.items()))

    def without_ssd(self) -> "CacheConfig":
        """This configuration with ``hot_cache_only=True``: what a manager runs on when its SSD
        tier cannot be opened (the SSD settings stay, inert)."""
        return dataclasses.replace(self, hot_cache_only=True)

    # ----------------------------------------------------------------------------- sources

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The configurable fields, in display order."""
        return tuple(_FIELD_SPECS)

    @classmethod
    def field_help(cls, name: str) -> str:
        """One-line description of a field (used by the CLI and docs)."""
        return _FIELD_SPECS[name][1]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CacheConfig":
        """Defaults overlaid with PAGED_CACHE_<FIELD> variables (unknown PAGED_CACHE_* keys raise)."""
        return cls.layered(environ=os.environ if environ is None else environ)

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> "CacheConfig":
        """Defaults overlaid with a TOML file's [paged_cache] table (or its top level)."""
        return cls.layered(toml_path=path)

    @classmethod
    def layered(cls, *, toml_path: str | os.PathLike | None = None,
                environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                override_source: str | Mapping[str, str] = "constructor") -> "CacheConfig":
        """Merge default < TOML < env < overrides, and record each value's source in ``sources``
        (``override_source``: one source for every override, or one per field)."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        layers = []
        if toml_path is not None:
            layers.append(read_toml(toml_path))
        if environ is not None:
            layers.append(read_env(environ))
        if overrides:
            unknown = sorted(set(overrides) - set(_FIELD_SPECS))
            if unknown:
                raise ValueError(f"{unknown[0]}: unknown setting; expected one of "
                                 f"{', '.join(_FIELD_SPECS)}")
            layers.append({k: (v, override_source if isinstance(override_source, str)
                                   else override_source[k]) for k, v in overrides.items()})
        for layer in layers:
            for name, (value, source) in layer.items():
                values[name], sources[name] = value, source
        return cls(**values, origin=sources)

    # ----------------------------------------------------------------------------- views

    def to_dict(self) -> dict[str, Any]:
        """Field values as JSON-friendly types (paths as strings, the remote URL without password,
        a secret as ***)."""
        return {n: str(v) if isinstance(v, Path) else v.redacted() if isinstance(v, RemoteURL)
                else v.shown() if isinstance(v, Secret) else v
                for n in _FIELD_SPECS for v in [getattr(self, n)]}

    def ssd_budget_bytes(self, cache_bytes: int = 0) -> int:
        """The SSD budget in bytes: explicit sizes are capped at the filesystem's size; "auto" is
        SSD_AUTO_SHARE of (free space + `cache_bytes`, the bytes the cache already holds there)."""
        total, free = filesystem_space(self.ssd_dir)
        if self.ssd_max_bytes == "auto":
            return int(SSD_AUTO_SHARE * min(free + cache_bytes, total))
        if self.ssd_max_bytes > total:
            log.warning("ssd_max_bytes %s exceeds the filesystem size %s; capping it",
                        format_size(self.ssd_max_bytes), format_size(total))
            return total
        return self.ssd_max_bytes


def read_env(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """PAGED_CACHE_<FIELD> variables as {field: (raw string, "env:NAME")}; unknown ones raise
    (REMOTE_PASSWORD_ENV is no field: the remote tier reads it when it connects)."""
    out = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key == REMOTE_PASSWORD_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in _FIELD_SPECS:
            raise ValueError(f"{key}: unknown setting; expected one of "
                             f"{', '.join(ENV_PREFIX + n.upper() for n in _FIELD_SPECS)}")
        out[name] = (value, f"env:{key}")
    return out


def read_toml(path: str | os.PathLike) -> dict[str, tuple[Any, str]]:
    """Settings of a TOML file: its [paged_cache] table if present, else its top level."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file: cannot read TOML from {path}: {exc}") from exc
    table = doc.get(TOML_TABLE) if isinstance(doc.get(TOML_TABLE), dict) else doc
    where = f"{path}[{TOML_TABLE}]" if table is not doc else str(path)
    unknown = sorted(set(table) - set(_FIELD_SPECS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown setting in {where}; expected one of "
                         f"{', '.join(_FIELD_SPECS)}")
    return {name: (value, f"toml:{path}") for name, value in table.items()}
