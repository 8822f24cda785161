"""Tenants of an OpenAI-compatible server: a request's cache salt and the namespace it gives the
request's blocks, so tenants never share a prefix (docs/integration.md, "Tenants").

The salt is the request's ``cache_salt`` body field (the name vLLM uses), or its ``X-Cache-Salt``
header for clients that cannot add body fields, or, when the server maps it
(``cache_salt_from_user``), its OpenAI ``user`` field. Its namespace holds a digest of it, never
the salt itself (block files and listings carry their namespace). Engines that serve a request
across threads or processes carry it in ``CURRENT_SALT`` (set where the request is handled and
where its cache is fetched) and on their own request objects (``attach_salt``).
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from typing import Any, Mapping

SALT_FIELD = "cache_salt"
SALT_HEADER = "X-Cache-Salt"
USER_FIELD = "user"
MAX_SALT_CHARS = 1024
_ARGS_ATTRIBUTE = "paged_cache_salt"  # on a request's generation arguments
_DOMAIN = b"paged-cache/cache-salt/v1\0"

CURRENT_SALT: ContextVar[str | None] = ContextVar("paged_cache_salt", default=None)
"""The salt of the request being handled (asyncio task or thread): None outside a request and
for an unsalted one. An engine adapter sets it where it knows the request and reads it where
the request's cache is fetched."""


class SaltError(ValueError):
    """A request's salt is not a non-empty string, or its body and header name two."""


def request_salt(body: bytes | None, headers: Mapping[str, str], *,
                 from_user: bool) -> str | None:
    """The salt of a request with JSON ``body`` (None or unreadable: none from it; the server
    answers such a body itself) and ``headers``; SaltError when one is given but not valid."""
    try:
        fields = json.loads(body.decode()) if body is not None else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        fields = None
    fields = fields if isinstance(fields, dict) else {}
    salt, header = fields.get(SALT_FIELD), headers.get(SALT_HEADER)
    for value, where in ((salt, f"the {SALT_FIELD} field"), (header, f"the {SALT_HEADER} header")):
        if value is not None and (not isinstance(value, str) or not value
                                  or len(value) > MAX_SALT_CHARS):
            raise SaltError(f"{SALT_FIELD}: {where} must be a non-empty string of at most "
                            f"{MAX_SALT_CHARS} characters")
    if salt is not None and header is not None and salt != header:
        raise SaltError(f"{SALT_FIELD}: the {SALT_FIELD} field and the {SALT_HEADER} header "
                        "differ; send one")
    salt = salt if salt is not None else header
    user = fields.get(USER_FIELD)
    if salt is None and from_user and isinstance(user, str) and user:
        return user
    return salt


def salted_namespace(namespace: str | None, salt: str | None) -> str | None:
    """The namespace of a request's blocks: the model's (``namespace``), and with a salt a
    digest of the salt beside it (no two salts, and no salt and none, share one)."""
    if salt is None:
        return namespace
    digest = hashlib.blake2b(_DOMAIN + salt.encode(), digest_size=16).hexdigest()
    return json.dumps([namespace or "", f"salt:{digest}"])


def error_body(error: SaltError) -> bytes:
    """The JSON body (OpenAI's error shape) of the 400 answer to a request whose salt is not
    valid."""
    return json.dumps({"error": {"message": str(error), "type": "invalid_request_error",
                                 "param": SALT_FIELD, "code": None}}).encode()


def salt_of_args(args: Any) -> str | None:
    """The salt a server attached to a request's generation arguments or request object
    (``attach_salt``)."""
    return getattr(args, _ARGS_ATTRIBUTE, None)


def attach_salt(args: Any, salt: str | None) -> None:
    """Carry ``salt`` on a request's generation arguments or request object (which the server
    hands to its generation thread, or pickles to another process or rank)."""
    setattr(args, _ARGS_ATTRIBUTE, salt)

