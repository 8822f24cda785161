"""The command that installs an optional part (an extra) of paged-cache, for every message that
names one: paged-cache is not on the package index, so it installs from a clone."""

from __future__ import annotations


def install_command(extra: str) -> str:
    """How to install ``extra`` today, e.g. "pip install -e '.[remote]' (in a clone of
    paged-cache)"."""
    return f"pip install -e '.[{extra}]' (in a clone of paged-cache)"
