"""Fixtures of the reliability suite: a small real filesystem, and a figures recorder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPORT_ENV = "RELIABILITY_REPORT"  # not PAGED_CACHE_*: that prefix is the configuration's


@pytest.fixture
def record() -> Callable[..., None]:
    """record(test, **figures): print the figures and, if $RELIABILITY_REPORT names a
    file, append them there as one JSON line (docs/reliability.md quotes the last long run)."""
    def write(test: str, **figures: object) -> None:
        line = json.dumps({"test": test, **figures}, sort_keys=True)
        print(line)
        target = os.environ.get(REPORT_ENV)
        if target:
            with open(target, "a") as fh:
                fh.write(line + "\n")
    return write


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory on a real 4 MiB filesystem: a tmpfs mount, else a loop-mounted ext4 image.

    Yields (mount point, kind); unmounted in teardown. Skips when neither can be mounted here.
    """
    mnt = tmp_path / "small"
    mnt.mkdir()
    kind = None
    if _run("mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)):
        kind = "tmpfs"
    else:
        image = tmp_path / "small.img"
        with open(image, "wb") as fh:
            fh.truncate(4 << 20)
        if (shutil.which("mkfs.ext4") and _run("mkfs.ext4", "-q", "-F", str(image))
                and _run("mount", "-o", "loop", str(image), str(mnt))):
            kind = "ext4-loop"
    if kind is None:
        pytest.skip("cannot mount a small filesystem here (needs root: tmpfs or a loop device)")
    try:
        yield mnt, kind
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
