"""The manifest an SSD tier works on: opened (waiting for another process's write lock, rebuilt
from the files when damaged), reconciled with the block files and evicted down to the budget by
a background pass that starts at open, and reopened after damage or another process's rebuild
(``recover``, which reconciles on the calling thread)."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from typing import Callable

from paged_cache.tiers.ssd.block_files import BlockFiles
from paged_cache.tiers.ssd.files import (MANIFEST_FILES, MANIFEST_NAME, create_manifest_file,
                                         rebuild_manifest)
from paged_cache.tiers.ssd.manifest import (BUSY_TIMEOUT_SECONDS, Manifest, ManifestBusy,
                                            ManifestDamaged, ManifestError, ManifestReplaced,
                                            is_damage)
from paged_cache.tiers.ssd.reconcile import Reconciliation

log = logging.getLogger("paged_cache.ssd")

OPEN_WAIT_SECONDS = 120.0  # how long open waits for another process's write lock on the manifest


class OpenManifest:
    """The SSD tier's manifest (``current``), kept usable: see module doc. ``count`` counts the
    tier's events, ``count_evicted`` the blocks evicted by the pass, ``on_reopen`` runs after a
    reopen (the reconciliation adopted every renamed file); ``busy_timeout_s``: how long one
    statement waits for another process's write lock. ``reconcile_seconds``: how long the pass
    took, None until it has finished (``wait_reconciled``)."""

    def __init__(self, files: BlockFiles, *, max_bytes: int, count: Callable[..., None],
                 count_evicted: Callable[[list[tuple[str, int]]], None],
                 on_reopen: Callable[[], None],
                 busy_timeout_s: float = BUSY_TIMEOUT_SECONDS) -> None:
        self.directory = files.directory
        self.max_bytes = max_bytes
        self._files = files
        self._root_fd = files.root_fd
        self._count = count
        self._count_evicted = count_evicted
        self._on_reopen = on_reopen
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()   # serializes reopening / rebuilding the manifest
        self.reconcile_seconds: float | None = None
        self._reconciled = threading.Event()  # set once the pass ended (done, failed or stopped)
        self._closed = False
        self.current = self._open(reconcile=False)
        self._evict(self.current)  # a smaller budget than the directory holds: trimmed now
        self._start_pass()

    def close(self) -> None:
        """Stop the reconciliation pass (after the folder it is in) and close the manifest."""
        self._closed = True
        self._stop_pass()
        self._reconciled.set()
        self.current.close()

    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Wait until the reconciliation pass has ended; True when it finished (False: stopped by
        ``close``, failed, or still running after ``timeout`` seconds)."""
        self._reconciled.wait(timeout)
        return self.reconcile_seconds is not None

    def _start_pass(self) -> None:
        """Start the reconciliation pass on its own thread (``_stop_pass`` ends it)."""
        self._stop = threading.Event()
        self._pass = threading.Thread(target=self._background, args=(self._stop,),
                                      name="paged-cache-ssd-reconcile", daemon=True)
        self._pass.start()

    def _background(self, stop: threading.Event) -> None:
        """The pass: reconcile every folder, then evict down to ``max_bytes`` again (what
        adoption added). A manifest error ends it: damage is recovered from (the reopen
        reconciles), anything else is logged; the tier goes on serving either way. Stopped, it
        leaves saying when reconciliation ended to whoever stopped it (``close``, ``recover``)."""
        started = time.perf_counter()
        manifest, ended = self.current, True
        try:
            if Reconciliation(manifest, self._files, self._count, stop).run():
                self._evict(manifest)  # what the adopted files added
                self.reconcile_seconds = time.perf_counter() - started
            else:
                ended = False
        except (OSError, sqlite3.Error, ManifestError) as exc:
            if stop.is_set():
                ended = False
            elif not (self.recover(exc) and self.reconcile_seconds is not None):
                log.warning("reconciliation of %s stopped (%s): files without rows stay "
                            "unindexed until the next open", self.directory, exc)
        finally:
            if ended:
                self._reconciled.set()

    def _evict(self, manifest: Manifest) -> None:
        """Evict down to ``max_bytes`` (nothing to do unless over it)."""
        self._count_evicted(manifest.evict_to(self.max_bytes, self._files.remove,
                                              self._files.exists))

    def _stop_pass(self) -> None:
        """End the background pass (after the folder it is in) and wait for it, unless called
        from it."""
        self._stop.set()
        if self._pass is not threading.current_thread():
            self._pass.join()

    def _resume_pass(self, usable: bool) -> bool:
        """After a recovery that reopened nothing: a pass it stopped before the end starts again
        (unless it is the caller: it reports its error itself); returns ``usable``."""
        if (self.reconcile_seconds is None and not self._closed
                and self._pass is not threading.current_thread()):
            self._start_pass()
        return usable

    def _open(self, damaged: int | None = None, *, reconcile: bool = True) -> Manifest:
        """Open the manifest and, if ``reconcile``, reconcile it with the files (else the
        background pass does), waiting up to OPEN_WAIT_SECONDS for another process's write lock.

        Only damage (found opening or reconciling; ``damaged``: the inode of a manifest found
        damaged before) leads to a rebuild from the block files: a lock is waited for, then
        reported (ManifestBusy); other errors (read-only, out of space) are raised as they are.
        """
        deadline = time.monotonic() + OPEN_WAIT_SECONDS
        waiting = rebuilt = False
        while True:
            self._clear_entries()
            if damaged is not None:
                rebuild_manifest(self._root_fd, damaged)
                damaged, rebuilt = None, True
            create_manifest_file(self._root_fd)
            try:
                manifest = Manifest(self.directory / MANIFEST_NAME, busy_timeout_s=self._busy_timeout_s)
            except ManifestBusy as exc:
                if time.monotonic() >= deadline:
                    raise
                if not waiting:
                    waiting = True
                    log.warning("%s; waiting up to %g s for it", exc, OPEN_WAIT_SECONDS)
                continue
            except ManifestDamaged as exc:
                if rebuilt:  # damaged again right after a rebuild: not a damage a rebuild fixes
                    raise
                self._rebuilding(exc)
                damaged = exc.inode
                continue
            try:
                started = time.perf_counter()
                if reconcile:
                    Reconciliation(manifest, self._files, self._count).run()
                    self.reconcile_seconds = time.perf_counter() - started
            except BaseException as exc:
                manifest.close()
                if not is_damage(exc) or rebuilt:
                    raise
                self._rebuilding(exc)
                damaged = manifest.inode
                continue
            if waiting:
                log.info("manifest lock obtained")
            return manifest

    def _clear_entries(self) -> None:
        """Remove whatever takes a manifest file's name without being a regular file."""
        for name in MANIFEST_FILES:
            try:
                st = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                continue
            log.warning("removing %s/%s: not a regular file", self.directory, name)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=self._root_fd)
            else:
                os.unlink(name, dir_fd=self._root_fd)

    def _rebuilding(self, reason: object) -> None:
        self._count("manifest_rebuilds")
        log.warning("manifest damaged (%s): rebuilding it from the block files", reason)

    def recover(self, exc: BaseException) -> bool:
        """After a manifest error: reopen the manifest if it is damaged (rebuilt from the block
        files, WARNING, counted) or was rebuilt by another process; True when the manifest is
        usable again (reopened now, or already by another thread). Anything else: False."""
        damaged = is_damage(exc)
        if not damaged and not isinstance(exc, ManifestReplaced):
            return False
        self._stop_pass()  # a reopen reconciles: the pass must not go on with the old manifest
        with self._lock:
            old = self.current
            try:  # the error may be from a manifest another thread has replaced meanwhile
                if damaged and old.find_damage() is None:
                    return self._resume_pass(True)
                if not damaged:
                    old.check_current()
                    return self._resume_pass(True)
            except ManifestReplaced:
                pass
            except sqlite3.Error as again:
                log.warning("manifest could not be checked (%s)", again)
                return self._resume_pass(False)
            if damaged:
                self._rebuilding(exc)
            old.close()
            try:
                self.current = self._open(old.inode if damaged else None)
            except (OSError, sqlite3.Error, ManifestError) as again:
                log.warning("manifest could not be reopened (%s); SSD writes fail until it can", again)
                return False
            finally:
                self._reconciled.set()
            self._on_reopen()  # renamed files were adopted by the reconciliation
            return True

    def file_bytes(self) -> int:
        """Bytes of the manifest's own files (database and WAL)."""
        total = 0
        for name in MANIFEST_FILES[:2]:
            try:
                total += os.stat(name, dir_fd=self._root_fd, follow_symlinks=False).st_size
            except OSError:
                pass
        return total
