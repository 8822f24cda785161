"""Files of a cache directory: names, safe opening and reading, and whether their writers live.

Shared by the SSD tier, its startup reconciliation and the offline inventory / maintenance
tools, so every one of them names, opens and judges files the same way.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import stat

from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.manifest import now

log = logging.getLogger("paged_cache.ssd")

MANIFEST_NAME = "manifest.sqlite"
MANIFEST_FILES = (MANIFEST_NAME, MANIFEST_NAME + "-wal", MANIFEST_NAME + "-shm")
STALE_SECONDS = 3600.0     # a temp file / reservation this old is abandoned even if its pid lives
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# what opening with READ_FLAGS fails with when something not a file was planted under a block's
# name (a symlink: ELOOP, EMLINK on BSDs; a socket: ENXIO); any other error says nothing of it
PLANTED = frozenset({errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR})
SUFFIX_TO_COMPRESSION = {suffix: comp for comp, suffix in fmt.SUFFIXES.items()}
def file_compression(blocks_fd: int, key: str, order: tuple[str, ...]) -> str | None:
    """The compression of the block's regular file under blocks/ if one exists, trying ``order``
    (symlinks do not count)."""
    for comp in order:
        try:
            st = os.stat(fmt.block_path(key, comp), dir_fd=blocks_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return comp
    return None


class CacheDirError(ValueError):
    """The cache directory itself cannot be used: the message names the argument, the path and why."""

    def __init__(self, path: os.PathLike | str, reason: str, argument: str = "directory") -> None:
        super().__init__(f"{argument}: {os.fspath(path)!r} {reason}")
        self.path, self.reason = path, reason

    def naming(self, argument: str) -> "CacheDirError":
        """The same error naming ``argument`` (the caller's name for the directory)."""
        return CacheDirError(self.path, self.reason, argument)


def open_cache_root(path: os.PathLike | str) -> int:
    """Open (creating 0700) the cache directory itself; CacheDirError saying why it cannot be
    used (not creatable, not a directory, not ours, unreadable, on a read-only filesystem). An
    existing directory others could write to is tightened to 0700 with one WARNING naming it."""
    try:
        fd = open_private_dir(None, os.fspath(path), warn=True)
    except CacheDirError as exc:  # a file or symlink in its place, another owner
        raise CacheDirError(path, exc.reason) from None
    except OSError as exc:
        where = "" if exc.filename in (None, os.fspath(path)) else f" at {exc.filename!r}"
        raise CacheDirError(path, f"cannot be created or opened: {exc.strerror}{where}") from None
    except ValueError as exc:  # e.g. an embedded NUL byte
        raise CacheDirError(path, f"is not a usable path: {exc}") from None
    if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
        os.close(fd)
        raise CacheDirError(path, "is on a read-only filesystem (the SSD tier writes there)")
    return fd


def open_private_dir(dir_fd: int | None, name: str, *, warn: bool = False) -> int:
    """Open (creating 0700 if needed) a directory we own, refusing symlinks; its mode is made
    0700 (``warn``: with a WARNING naming it when group or others could write there)."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd) if dir_fd is not None else os.makedirs(name, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise CacheDirError(name, f"must be a real directory, not a symlink or file "
                                  f"({exc.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise CacheDirError(name, f"is owned by uid {st.st_uid}, not by this user")
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        if warn and mode & 0o022:
            log.warning("cache directory %s was writable by %s (mode %04o): another user could "
                        "have planted or changed files in it; its mode is now 0700",
                        os.path.abspath(name), "others" if mode & 0o002 else "its group", mode)
        os.fchmod(fd, 0o700)
    return fd


def create_manifest_file(root_fd: int) -> None:
    """Create an empty manifest file 0600 if there is none (SQLite gives -wal / -shm its mode)."""
    try:
        os.close(os.open(MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600, dir_fd=root_fd))
    except FileExistsError:
        pass


def rebuild_manifest(root_fd: int, inode: int | None) -> bool:
    """Replace the damaged manifest (the file with ``inode``) by an empty one, which the next open
    fills from the block files. Under an exclusive lock on the directory, and only while the file
    is still that inode: a second process finding the same damage never removes the rebuild.
    Returns False when another process had rebuilt it already."""
    fcntl.flock(root_fd, fcntl.LOCK_EX)
    try:
        try:
            current = os.stat(MANIFEST_NAME, dir_fd=root_fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            current = None
        if current is not None and current != inode:
            return False
        for name in MANIFEST_FILES:
            unlink_quiet(name, root_fd)
        create_manifest_file(root_fd)
        return True
    finally:
        fcntl.flock(root_fd, fcntl.LOCK_UN)


DRAIN_CHUNK = 1 << 20  # bytes per read of a file read only to bring it into the page cache


def drain(fd: int) -> int:
    """Read ``fd`` to its end, a chunk at a time into one scratch buffer; the bytes read."""
    buf = bytearray(DRAIN_CHUNK)
    total = 0
    while n := os.readv(fd, [buf]):
        total += n
    return total


def read_exact(fd: int, size: int) -> bytes | bytearray:
    """Read ``size`` bytes from ``fd`` at its offset (fewer only if the file is shorter): one read
    into a fresh buffer, not zero-filled first (a block file is read once, whole, when it is
    compressed or decoded: a fill would be a second pass over as many fresh pages), continued
    when it comes back short."""
    first = os.read(fd, size)
    if len(first) == size or not first:
        return first
    buf = bytearray(first)
    while len(buf) < size:
        more = os.read(fd, size - len(buf))
        if not more:
            break
        buf += more
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


OPEN_FILES = 8192  # descriptors a process with an SSD tier asks for (the soft limit, if lower)


def raise_open_files_limit(want: int = OPEN_FILES) -> int:
    """Raise the process's soft limit on open files to ``want`` (at most its hard limit) and
    return the limit now. A fetch reads each SSD block of a prompt in place from its own open
    file, all at once (a 128k-token prompt of 256-token blocks: 512 files), and macOS starts a
    process at 256; a read refused for want of descriptors is a counted miss, never damage."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("open files limit raised from %d to %d", soft, target)
            return target
        except (ValueError, OSError) as exc:  # macOS: above kern.maxfilesperproc
            log.debug("open files limit left at %d: %s", soft, exc)
    return soft
