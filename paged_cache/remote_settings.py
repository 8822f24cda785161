"""The remote tier's setting values: its URL (shown without the password), its secret (never
shown), the schemes, and whether a host is this machine (a shared tier off loopback is closed
unless a secret or ``remote_insecure`` opens it)."""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

REMOTE_SCHEMES = ("redis", "rediss", "valkey", "valkeys")  # "...s": TLS
TLS_SCHEMES = ("rediss", "valkeys")
SECRET_MIN_CHARS = 16         # remote_secret: shorter ones are refused (a MAC key must not be guessable)
LOOPBACK_NAMES = ("localhost",)  # host names taken as this machine without asking DNS


class RemoteURL(str):
    """A remote tier URL whose repr hides the password (configs are logged and printed)."""

    def redacted(self) -> str:
        """The URL with its password replaced by ***."""
        parts = urllib.parse.urlsplit(self)
        if parts.password is None:
            return str(self)
        user = parts.username or ""
        netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def __repr__(self) -> str:
        return repr(self.redacted())


class Secret(str):
    """A secret setting: its repr and ``shown`` never hold it (configs are logged and printed)."""

    def __repr__(self) -> str:
        return "'***'"

    def shown(self) -> str:
        return "***"


def parse_secret(value: Any, name: str) -> Secret | None:
    """``remote_secret``: None when empty, else a Secret of at least SECRET_MIN_CHARS characters
    (ValueError naming ``name``, never echoing the value)."""
    if value is None or (isinstance(value, str) and not value):
        return None
    if not isinstance(value, str):  # never echo the value: it may be the secret itself
        raise ValueError(f"{name}: expected a string of at least {SECRET_MIN_CHARS} characters, "
                         f"got a {type(value).__name__}")
    if len(value) < SECRET_MIN_CHARS:
        raise ValueError(f"{name}: expected at least {SECRET_MIN_CHARS} characters, got "
                         f"{len(value)} (a short secret can be guessed from what the server holds)")
    return Secret(value)


def is_loopback(host: str | None) -> bool:
    """True when ``host`` (a URL's host name) is this machine: a loopback address (127.0.0.0/8,
    ::1, an IPv4-mapped loopback) or ``localhost``. Other names are not resolved: a name could
    point anywhere, so it counts as another machine."""
    if not host:
        return False
    if host.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def parse_remote_url(value: Any, name: str) -> RemoteURL | None:
    """``remote_url``: None when empty, else a RemoteURL of a known scheme with a host and a
    numeric database (ValueError naming ``name``, the password never shown)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    form = f"a URL like redis://[user:password@]host:6379/0 (schemes: {', '.join(REMOTE_SCHEMES)})"
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected {form}, got {value!r}")
    try:
        parts = urllib.parse.urlsplit(value.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{name}: expected {form}; the URL does not parse ({exc})") from None
    if parts.scheme.lower() not in REMOTE_SCHEMES or not parts.hostname:
        raise ValueError(f"{name}: expected {form}, got {RemoteURL(value).redacted()!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{name}: database {db!r} in the URL path must be a number, e.g. /0")
    return RemoteURL(value.strip())
