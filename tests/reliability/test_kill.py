"""SIGKILL at random moments while a child process stores blocks through a PagedSSDCacheManager.

After every kill a fresh manager opens the directory: the manifest and the files agree, no temp
file survives or is counted, every block it serves is bit-exact (its checksum passed and it equals
what the child wrote under that key), startup stays fast, and what the kill lost is no more than
the write queue held (write-through: every put was queued before the child printed its index).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from helpers.blocks import key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import (SMALL, audit, discarded_by_writer, printed_indices, spawn,
                                 wait_for_line)

BUDGET = 1 << 20            # bytes on SSD (evictions start after a few runs)
QUEUE = 32 << 10            # write queue bound: the most a kill may lose (plus blocks in flight)
RUN_LIMIT = 150             # blocks per child run (< BUDGET, so a run never evicts its own blocks)
MAX_BLOCK_BYTES = 4096     # largest random_block() payload: one in the writer, one on the caller
STARTUP_BOUND_S = 5.0       # generous: a fresh open reconciles without reading payloads


def test_sigkill_at_random_moments(tmp_path: Path, long_run: bool, record) -> None:
    root, log = tmp_path / "cache", tmp_path / "child.log"
    rng = random.Random(20240607)
    kills = 200 if long_run else 20
    start, stored, lost, served, open_times = 0, 0, 0, 0, []
    ever: set[str] = set()
    for k in range(kills):
        child = spawn("writer", log, root=str(root), start=start, budget=BUDGET,
                      compression="lz4" if k % 3 == 1 else "none", queue=QUEUE, limit=RUN_LIMIT)
        if rng.random() < 0.1:   # sometimes during import / open / startup reconciliation
            time.sleep(rng.uniform(0.0, 1.0))
        else:
            wait_for_line(log, child, "ready")
            time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        done = printed_indices(log)

        t0 = time.perf_counter()
        with new_manager(root, **SMALL | dict(ssd_max_bytes=BUDGET)) as manager:
            open_times.append(time.perf_counter() - t0)
            assert open_times[-1] < STARTUP_BOUND_S
            assert manager.tier("ssd").wait_reconciled(timeout=60)  # the pass after the open
            files = audit(root, BUDGET).files     # no temp file, rows == files, totals, budget
            last = max(done, default=start - 1) + 1  # the child may have put one unprinted block
            ever.update(key_of(i) for i in range(start, last + 1))
            for key in files:
                assert key in ever, "a file the children never wrote"
                got = manager.get(key)
                assert got is not None, "a complete file is always served"
                assert same_block(got, random_block(key))
            assert manager.stats()["ssd"]["damaged"] == 0
            # What this run lost: printed (so queued) blocks, not discarded, without a file.
            gone = {discarded_by_writer(i) for i in done}
            missing = [i for i in done if i not in gone and key_of(i) not in files]
            lost_bytes = sum(random_block(key_of(i)).nbytes for i in missing)
            assert lost_bytes <= QUEUE + 2 * MAX_BLOCK_BYTES, (missing, lost_bytes)
        stored += len(done)
        lost += len(missing)
        served += len(files)
        start = last + 1
    record("kill", kills=kills, blocks_put=stored, blocks_lost_in_queue=lost,
           blocks_verified=served, max_open_s=round(max(open_times), 4),
           median_open_s=round(sorted(open_times)[len(open_times) // 2], 4))
