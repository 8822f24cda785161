"""One serving host of the remote-tier tests, run as a real subprocess: its own SSD directory, the
shared server. Reads commands from stdin, answers one JSON line each:

    store SEED   prefill and store prompt(SEED), flush (the remote queue is sent)
    fetch SEED   fetch prompt(SEED) + 2 tokens, continue warm and cold: exact or it raises
    stats        the manager's stats
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from paged_cache.prefix_cache import BlockAwarePrefixCache  # noqa: E402
from paged_cache.testing import tiny_model  # noqa: E402
from helpers.managers import new_manager  # noqa: E402
from helpers.prefix import assert_exact, prompt, store_prompt  # noqa: E402

BLOCK = 16
TOKENS = 4 * BLOCK + 5


def main(ssd_dir: str, url: str) -> None:
    model = tiny_model("llama")
    with new_manager(Path(ssd_dir), block_size=BLOCK, remote_url=url, remote_timeout=5.0) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            before = manager.stats()["hits"]["remote"]
            if command == "store":
                store_prompt(model, prefix, prompt(TOKENS, seed=int(arg)))
                manager.flush()
                out = {"ok": True}
            elif command == "fetch":
                n = assert_exact(model, prefix, prompt(TOKENS, seed=int(arg)) + [1, 2])
                out = {"n": n, "tier": prefix.last_fetch.tier,
                       "remote_hits": manager.stats()["hits"]["remote"] - before}
            elif command == "stats":
                out = manager.stats()
            else:
                out = {"error": f"unknown command {command!r}"}
            print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
