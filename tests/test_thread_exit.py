"""A thread that fetched, ran the model and stored, then exits, leaves the process running: on
mlx < 0.32 a thread's compiled functions (qwen3_next's gated delta step) were freed without the
GIL at its exit and aborted the process (paged_cache/compile_guard.py). Run in a subprocess, as a
server's generation thread ends before its cache is closed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, threading, time
    import mlx.core as mx
    from paged_cache import CacheConfig, PagedSSDCacheManager
    from paged_cache.prefix_cache import BlockAwarePrefixCache
    from paged_cache.testing.models import tiny_model

    model = tiny_model("qwen3_next")
    manager = PagedSSDCacheManager(CacheConfig(block_size=16, hot_cache_only=True))
    prefix = BlockAwarePrefixCache(manager, model)
    tokens = [(i * 37 + 5) % 256 for i in range(40)]

    def generation_thread():
        cache, n = prefix.fetch(tokens)
        cache = cache or prefix.make_cache()
        mx.eval(model(mx.array([tokens[n:]]), cache=cache))
        prefix.store(tokens, cache)

    for _ in range(3):  # each thread's exit frees what it compiled
        worker = threading.Thread(target=generation_thread)
        worker.start()
        worker.join()
        gc.collect()
        time.sleep(0.2)
    manager.close()
    print("closed")
""")


def test_a_generation_thread_exiting_leaves_the_process_to_close_its_cache() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr[-3000:]
