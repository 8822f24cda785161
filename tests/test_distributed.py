"""A model sharded over two MLX distributed ranks (mlx.launch, ring backend on 127.0.0.1).

Every rank loads its shard (tensor parallel: its heads; pipeline: its layers), stores a prompt,
has its blocks disturbed or not, and fetches a longer prompt: both ranks must restore the same
prefix, exactly (next-token logits equal a cold prefill of the same shard: max abs diff 0.0),
and nothing may hang (each job runs under a timeout that fails the test). The rank side is
tests/distributed/scenarios.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paged_cache.testing import write_model_dir
from paged_cache.testing.ranks import can_split, launch

SCENARIOS = Path(__file__).parent / "distributed" / "scenarios.py"
JOB_TIMEOUT = 300.0  # seconds for one job of every scenario on both ranks (about 50 s here)

# (architecture, how it is split): a KV model and a hybrid (recurrent + attention) by heads; a
# hybrid and a sliding-window model by layers (mlx-lm 0.31 has no pipeline stages for qwen3_next)
SHARDINGS = [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_next", "pipeline"),
             ("ministral3", "pipeline")]

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
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run every scenario on two ranks once per sharding; the job's work directory."""
    arch, mode = request.param
    if not can_split(arch, mode):
        pytest.skip(f"the installed mlx-lm cannot split {arch} by {mode}")
    root = tmp_path_factory.mktemp(f"{arch}-{mode}")
    model = write_model_dir(root / "model", arch)
    work = root / "work"
    work.mkdir()
    run = launch([str(SCENARIOS), "--model", str(model), "--mode", mode, "--work", str(work)],
                 timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.stdout[-4000:]
    return work


@pytest.fixture
def ranks(job: Path) -> list[dict]:
    """What each rank saw, by scenario."""
    return [json.loads((job / f"rank{r}.json").read_text()) for r in range(2)]


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


def test_the_shards_are_told_apart(ranks: list[dict], job: Path) -> None:
    """Each rank names its shard, and `paged-cache chains` on the directory both ranks shared
    shows two models (one per shard), 8 blocks each."""
    shards = [r["shared_dir"]["stats"]["shard"] for r in ranks]
    assert shards[0] != shards[1] and all(s.startswith(f"rank {i}/2") for i, s in enumerate(shards))
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "chains", "--json",
                          str(job / "shared")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    models = json.loads(out.stdout)
    assert sorted(m["shard"] for m in models) == sorted(shards)
    assert [m["blocks"] for m in models] == [8, 8] and {m["name"] for m in models} == {"tiny"}


def test_one_ranks_fetch_plan_decides_for_the_group(ranks: list[dict]) -> None:
    """Rank 1's plan declines the restore its rates call slower than the prefill: every rank
    then prefills the stored tokens, exactly; rank 0 gives up what it alone would restore."""
    seen = [r["plan_on_one_rank"] for r in ranks]
    # no read rate yet: restored, both ranks alike; rank 1's cut-off, timing its read against a
    # prefill that fast, may stop it before the end (on a loaded machine it did, at 224)
    assert seen[0]["first"] == seen[1]["first"] and 0 < seen[0]["first"] <= 256, seen
    assert [s["n"] for s in seen] == [0, 0] and all(s["diff"] == 0.0 for s in seen), seen
    assert seen[1]["stats"]["recomputed_tokens"] == 256, seen
    assert seen[0]["stats"]["recomputed_tokens"] == 0, seen
    assert seen[0]["stats"]["tokens_given_up_to_group"] == 256, seen


def test_scheduler_turns_equal_an_uncached_run_on_every_rank(ranks: list[dict]) -> None:
    """Three turns of one conversation: replies equal the uncached run's, and both ranks reused
    the same tokens (the second and third turns hit)."""
    got = [r["scheduler"] for r in ranks]
    assert all(g["same"] and g["refused"] for g in got), got  # refused: group=None vs a group
    assert got[0]["cached"] == got[1]["cached"], got
    assert got[0]["cached"][0] == 0 and all(c > 0 for c in got[0]["cached"][1:]), got


@pytest.mark.parametrize("arch, mode", [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_two_sharded_deployments_share_a_remote_tier_rank_by_rank(arch: str, mode: str,
                                                                   tmp_path: Path) -> None:
    """Deployment A stores through a real Valkey / Redis server; deployment B (new processes,
    empty local tiers) restores every block from it, each rank its own shard's, exactly."""
    from paged_cache.testing.server import ValkeyServer, client

    if not can_split(arch, mode):
        pytest.skip(f"the installed mlx-lm cannot split {arch} by {mode}")
    model = write_model_dir(tmp_path / "model", arch)
    with ValkeyServer() as server:
        seen = []
        for step in ("remote_store", "remote_fetch"):
            work = tmp_path / step
            work.mkdir()
            run = launch([str(SCENARIOS), "--model", str(model), "--mode", mode, "--work",
                          str(work), "--scenarios", step, "--remote-url", server.url],
                         timeout=JOB_TIMEOUT)
            assert run.returncode == 0, run.stdout[-4000:]
            seen.append([json.loads((work / f"rank{r}.json").read_text())[step] for r in range(2)])
        blocks = [k for k in client(server.url).keys("paged-cache:*:b:*")]
    stored, fetched = seen
    assert [s["remote"] for s in stored] == [8, 8]   # each rank wrote its own 8 blocks
    assert len(blocks) == 16                        # two shards, never one key for both
    for rank, got in enumerate(fetched):
        assert (got["n"], got["diff"], got["remote_hits"]) == (256, 0.0, 8), (rank, got)


def test_one_process_has_no_group_and_keeps_its_fingerprint(tmp_path: Path) -> None:
    """Outside mlx.launch the default (the world group) has one rank: no group, no collective,
    no shard in the key, and stats without group fields; a group of another type is refused."""
    from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
    from paged_cache.testing import tiny_model

    model = tiny_model("llama")
    with PagedSSDCacheManager(CacheConfig(hot_cache_only=True, block_size=16)) as manager:
        default = BlockAwarePrefixCache(manager, model)
        alone = BlockAwarePrefixCache(manager, model, group=None)
        assert default.group is None and default.shard is None
        assert default.layout.ready() and default.fingerprint == alone.fingerprint
        assert "rank" not in default.stats() and "agreements" not in default.stats()
        with pytest.raises(TypeError, match="group: expected an mx.distributed.Group"):
            BlockAwarePrefixCache(manager, model, group="world")


def test_stop_ends_a_rank_that_outlived_its_launcher() -> None:
    """A rank can outlive mlx.launch (its peer failed to start and it waits on the ring): stop()
    signals the whole process group even when the launcher has already ended."""
    import time

    from paged_cache.testing.ranks import stop

    launcher = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    orphan = int(launcher.stdout.readline())
    launcher.wait(timeout=30)
    assert _state(orphan) not in ("gone", "Z")  # alive after its launcher ended
    stop(launcher, grace=1.0)
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously
    while _state(orphan) not in ("gone", "Z"):  # killed (a zombie until its parent reaps it)
        assert time.monotonic() < deadline, f"pid {orphan} survived stop(): {_state(orphan)}"
        time.sleep(0.05)


def _state(pid: int) -> str:
    """A process's state letter (``ps``: Linux and macOS alike), or "gone"."""
    run = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return run.stdout.strip()[:1] or "gone"
