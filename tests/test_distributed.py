"""A model sharded over two MLX distributed ranks (mlx.launch, ring backend on 127.0.0.1).

Every rank loads its shard (tensor parallel: its heads; pipeline: its layers), stores a prompt,
has its blocks disturbed or not, and fetches a longer prompt: both ranks must restore the same
prefix, exactly (next-token logits equal a cold prefill of the same shard: max abs diff 0.0),
and nothing may hang (each job runs under a timeout that fails the test). The rank side is
tests/distributed/scenarios.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_cache.testing import write_model_dir
from paged_cache.testing.ranks import launch

SCENARIOS = Path(__file__).parent / "distributed" / "scenarios.py"
JOB_TIMEOUT = 300.0  # seconds for one job of every scenario on both ranks (about 50 s here)

# (architecture, how it is split): a KV model and a hybrid (recurrent + attention) by heads,
# and a hybrid by layers
SHARDINGS = [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_next", "pipeline")]

# scenario -> the prefix both ranks must restore (stored: 256 tokens of a 300-token prompt)
EXPECTED = {
    "shared_dir": 256,               # both ranks on one ssd_dir: their shards never mix
    "dir_per_rank": 256,
    "dir_lost": 0,                   # rank 1's directory is gone: every rank misses
    "blocks_lost_shared_dir": 0,     # rank 1's blocks discarded from the shared directory
    "block_damaged": 96,             # rank 1's block [96, 128) fails its checksum
    "hot_only_block_dropped": 96,    # hot_cache_only: rank 1 dropped that block
}


@pytest.fixture(scope="module", params=SHARDINGS, ids=lambda s: f"{s[0]}-{s[1]}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    arch, mode = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{mode}")
    model = write_model_dir(root / "model", arch)
    work = root / "work"
    work.mkdir()
    job = launch([str(SCENARIOS), "--model", str(model), "--mode", mode, "--work", str(work)],
                 timeout=JOB_TIMEOUT)
    assert job.returncode == 0, job.stdout[-4000:]
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("scenario", EXPECTED)
def test_every_rank_restores_the_same_prefix_exactly(ranks: list[dict], scenario: str) -> None:
    seen = [r[scenario] for r in ranks]
    for rank, got in enumerate(seen):
        assert got["n"] == EXPECTED[scenario], (rank, got)
        assert got["diff"] == 0.0, (rank, got)
        assert got["stats"]["rank"] == rank and got["stats"]["group_size"] == 2
        assert got["stats"]["agreements"] == 1 and got["stats"]["fetch_errors"] == 0
    # one collective when the ranks agree at once; a second round when one rank had less
    rounds = {s["stats"]["agreement_rounds"] for s in seen}
    assert rounds == ({1} if EXPECTED[scenario] == 256 else {2}), seen
    if scenario == "hot_only_block_dropped":
        # rank 0 rebuilt 256 tokens (taking its blocks out of RAM) before the group agreed on
        # 96: it stored them back, so it still holds all 8; rank 1 the 7 it did not drop, less
        # those the final fetch lent to its cache (KV layouts only)
        assert seen[0]["held_after"] == 8, seen
        assert seen[1]["held_after"] + seen[1]["stats"]["blocks_taken"] == 7, seen


def test_the_shards_are_told_apart(ranks: list[dict]) -> None:
    shards = [r["shared_dir"]["stats"]["shard"] for r in ranks]
    assert shards[0] != shards[1] and all(s.startswith(f"rank {i}/2") for i, s in enumerate(shards))


def test_scheduler_turns_equal_an_uncached_run_on_every_rank(ranks: list[dict]) -> None:
    """Three turns of one conversation: replies equal the uncached run's, and both ranks reused
    the same tokens (the second and third turns hit)."""
    got = [r["scheduler"] for r in ranks]
    assert all(g["same"] for g in got), got
    assert got[0]["cached"] == got[1]["cached"], got
    assert got[0]["cached"][0] == 0 and all(c > 0 for c in got[0]["cached"][1:]), got
