"""The remote tier's server side: the names of its keys on the server, the child listing entries,
and the client connection (valkey-py, no client-side retry).

Server keys (every part checked: block keys and fingerprints are 64 hex characters) are
``paged-cache:<format version>:b:<block key>`` for a block and
``paged-cache:<format version>:c:<fingerprint>:<parent key | root>`` for the hash of a parent's
children (field: child key, value: the child's meta minus its layer descriptors).
"""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from paged_cache.block import check_key, is_key
from paged_cache.config import REMOTE_PASSWORD_ENV
from paged_cache.remote_settings import TLS_SCHEMES, RemoteURL
from paged_cache.install import install_command
from paged_cache.tiers import format as fmt

KEY_PREFIX = f"paged-cache:{fmt.FORMAT_VERSION}"
TTL_STEP_MS = 4                # a block's TTL is this much shorter than its parent's
ROOT_NAME = "root"             # the child hash name part of a chain's first blocks


def block_name(key: str) -> str:
    """Server key of a block's value."""
    return f"{KEY_PREFIX}:b:{check_key(key)}"


def children_name(parent: str, fingerprint: str) -> str:
    """Server key of the hash listing the children of ``parent`` ("" = a chain's first blocks)."""
    if not is_key(fingerprint):
        raise ValueError(f"fingerprint: expected 64 lower-case hex characters, got {fingerprint!r:.80}")
    return f"{KEY_PREFIX}:c:{fingerprint}:{check_key(parent) if parent else ROOT_NAME}"


def child_entry(meta: dict[str, str]) -> str:
    """The child hash value of a block: its meta without the layer descriptors (JSON)."""
    return json.dumps({k: v for k, v in meta.items() if k != fmt.META_LAYERS},
                      sort_keys=True, separators=(",", ":"))


def parse_child_entry(value: Any) -> dict[str, str] | None:
    """A child hash value as meta (str -> str), or None when it is not one."""
    try:
        meta = json.loads(bytes(value).decode("utf-8"))
    except (TypeError, ValueError):
        return None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        return None
    return meta



def listing_name(meta: dict[str, str]) -> str | None:
    """The child hash a block belongs in, or None when its meta names no valid parent and model."""
    parent, fingerprint = meta.get(fmt.META_PARENT), meta.get(fmt.META_FINGERPRINT, "")
    if parent is None or not is_key(fingerprint) or (parent and not is_key(parent)):
        return None
    return children_name(parent, fingerprint)


def chain_ttl_ms(ttl: float, depth: int) -> int | None:
    """The TTL (ms) a block ``depth`` blocks from its chain's start gets at a write or a lookup
    that finds it (None: no ``remote_ttl``): TTL_STEP_MS less per block of depth (at most a
    quarter of the TTL less), so blocks renewed together expire, and are evicted under
    ``volatile-ttl``, leaves first, and a parent, renewed whenever a lookup passes it to a
    child, not before its children."""
    if ttl <= 0:
        return None
    full = int(ttl * 1000)
    return max(1, full - min(depth * TTL_STEP_MS, full // 4))


def depth_of(meta: dict[str, str]) -> int:
    """A block's depth in its chain from its meta (start / tokens; 0 when they are missing)."""
    try:
        start, tokens = int(meta.get(fmt.META_START, "0")), int(meta.get(fmt.META_TOKENS, "1"))
    except ValueError:
        return 0
    return max(0, start // max(1, tokens))


def client_module() -> Any:
    try:
        import valkey
    except ImportError as exc:
        raise ImportError("remote_url: the remote tier needs the valkey client; install it with "
                          f"{install_command('remote')}") from exc
    return valkey


@dataclass(frozen=True)
class TLSFiles:
    """Files of a TLS connection (``rediss://``): CA certificates that verify the server (None:
    the system's), and a client certificate with its key for servers that ask for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def of(cls, config: Any) -> "TLSFiles":
        """The TLS files a CacheConfig names (its remote_tls_* fields)."""
        paths = (config.remote_tls_ca, config.remote_tls_cert, config.remote_tls_key)
        return cls(*(None if p is None else os.fspath(p) for p in paths))

    def options(self) -> dict[str, Any]:
        """The client's keyword arguments: the server's certificate and host name verified;
        ValueError naming a file that cannot be read."""
        for what, path in (("remote_tls_ca", self.ca), ("remote_tls_cert", self.cert),
                           ("remote_tls_key", self.key)):
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{what}: {path!r} is not a readable file")
        return dict(ssl_ca_certs=self.ca, ssl_certfile=self.cert, ssl_keyfile=self.key,
                    ssl_cert_reqs="required", ssl_check_hostname=True)


def connect(url: str, *, timeout: float, cluster: bool = False, tls: TLSFiles | None = None) -> Any:
    """A client of ``url`` (a cluster client when ``cluster``: it connects to discover the
    shards, so it may raise the client's errors). No client-side retry: a failure is reported at
    once (the tier starts an outage and probes). The password comes from the URL or, without
    one there, from REMOTE_PASSWORD_ENV (a user may be in the URL alone). A TLS URL
    (``rediss://``, ``valkeys://``) verifies the server's certificate and host name."""
    valkey = client_module()
    from valkey.backoff import NoBackoff
    from valkey.retry import Retry

    parts = urllib.parse.urlsplit(url)
    password = None if parts.password is not None else os.environ.get(REMOTE_PASSWORD_ENV)
    options = dict(password=password, socket_timeout=timeout, socket_connect_timeout=timeout,
                   retry=Retry(NoBackoff(), 0), client_name="paged-cache")
    if parts.scheme.lower() in TLS_SCHEMES:
        options.update((tls or TLSFiles()).options())
    if cluster:
        from valkey.cluster import ValkeyCluster

        return ValkeyCluster.from_url(url, cluster_error_retry_attempts=1, **options)
    return valkey.Valkey.from_url(url, health_check_interval=0, **options)



def shown(url: str) -> str:
    """``url`` with its password hidden, for logs and stats."""
    return RemoteURL(url).redacted()
