"""Files of a cache directory: names, safe opening and reading, and whether their writers live.

Shared by the SSD tier, its startup reconciliation and the offline inventory / maintenance
tools, so every one of them names, opens and judges files the same way.
"""

from __future__ import annotations

import os
import stat

from paged_cache.tiers import format as fmt
from paged_cache.tiers.manifest import now

MANIFEST_NAME = "manifest.sqlite"
STALE_SECONDS = 3600.0     # a temp file / reservation this old is abandoned even if its pid lives
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SUFFIX_TO_COMPRESSION = {suffix: comp for comp, suffix in fmt.SUFFIXES.items()}
def file_compression(blocks_fd: int, key: str, order: tuple[str, ...]) -> str | None:
    """The compression of the block's regular file under blocks/ if one exists, trying ``order``
    (symlinks do not count)."""
    for comp in order:
        try:
            st = os.stat(f"{key[:2]}/{key}{fmt.SUFFIXES[comp]}", dir_fd=blocks_fd,
                         follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return comp
    return None


def open_private_dir(dir_fd: int | None, name: str) -> int:
    """Open (creating 0700 if needed) a directory we own, refusing symlinks."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd) if dir_fd is not None else os.makedirs(name, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise ValueError(f"directory: {name!r} must be a real directory, not a symlink or file "
                         f"({exc.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise ValueError(f"directory: {name!r} is owned by uid {st.st_uid}, not by this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def read_exact(fd: int, size: int) -> bytearray:
    """Read ``size`` bytes from ``fd`` (fewer only if the file is shorter)."""
    buf = bytearray(size)
    view, done = memoryview(buf), 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n == 0:
            return buf[:done]
        done += n
    return buf


def unlink_quiet(name: str, dir_fd: int) -> None:
    """Remove ``name`` under ``dir_fd``, ignoring any error (already gone, raced, ...)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Writer ids ("pid:token") of the SSD tiers open in this process: a reservation left by a closed
# tier of this same process is dead even though the pid is alive.
LIVE_WRITERS: set[str] = set()


def writer_alive(writer: str, created: float) -> bool:
    """Whether a reservation's writer ("pid:token") may still be writing."""
    pid = writer.split(":", 1)[0]
    if not pid.isdigit() or now() - created > STALE_SECONDS:
        return False
    if int(pid) == os.getpid():
        return writer in LIVE_WRITERS
    return pid_alive(int(pid))
