"""exo's real generate path with paged-cache as its prefix cache: exo's ``mlx_generate`` and
``ExoBatchGenerator`` (its code, from the checkout named by env ``EXO_SRC``, on Python 3.13)
serve chats with no cache (cold), exo's own ``KVPrefixCache`` and ``PagedKVPrefixCache``.
Collected with ``--engine exo``; skipped when ``EXO_SRC`` is not set (recipe and last result:
docs/integration.md, exo)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

EXO_SRC = os.environ.get("EXO_SRC")
if not EXO_SRC:
    pytest.skip("EXO_SRC is not set: these tests run exo's own code from its checkout "
                "(docs/integration.md, exo)", allow_module_level=True)
sys.path.insert(0, str(Path(EXO_SRC) / "src"))
os.environ.setdefault("EXO_DASHBOARD_DIR", str(Path(EXO_SRC) / "src"))  # exo wants a built UI

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from paged_cache.config import CacheConfig  # noqa: E402
from paged_cache.integrations.exo import compat  # noqa: E402
from paged_cache.integrations.exo.adapter import PagedKVPrefixCache  # noqa: E402
from paged_cache.integrations.exo.launcher import ServeError, runner_environ  # noqa: E402
from paged_cache.integrations.exo.settings import METRICS_ENV  # noqa: E402
from paged_cache.integrations.exo.prefix import FALLBACK_BASE  # noqa: E402
from paged_cache.manager import PagedSSDCacheManager  # noqa: E402
from paged_cache.testing import write_model_dir  # noqa: E402
from paged_cache.testing.exo_runs import (  # noqa: E402
    AGAIN, builder_cache_class, deepseek_v4_dir, play)

ARCHS = ("llama", "qwen3_next")   # a KV model and a hybrid (recurrent + attention)
SIZES = dict(conversations=3, system_chars=600, user_chars=700, max_tokens=8)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("models")
    return {arch: load(str(write_model_dir(root / arch, arch, printable_replies=True)))
            for arch in ARCHS}


def paged(tmp_path: Path, **config) -> PagedKVPrefixCache:
    config = {"block_size": 16, "ssd_dir": tmp_path / "ssd", "fetch_policy": "always-restore",
              **config}
    return PagedKVPrefixCache(None, manager=PagedSSDCacheManager(CacheConfig(**config)))


def test_installed_exo_is_the_one_served() -> None:
    assert compat.check() == []


@pytest.mark.parametrize("kind", ["sequential", "batch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_replies_equal_cold_and_reuse_at_least_exos_own(loaded, tmp_path, arch, kind) -> None:
    model, tokenizer = loaded[arch]
    cold = play(model, tokenizer, None, kind=kind, rounds=AGAIN, **SIZES)
    own = play(model, tokenizer, compat.KVPrefixCache(None), kind=kind, rounds=AGAIN, **SIZES)
    cache = paged(tmp_path)
    got = play(model, tokenizer, cache, kind=kind, rounds=AGAIN, **SIZES)
    assert [r.reply for r in got] == [r.reply for r in cold]
    assert [r.reply for r in own] == [r.reply for r in cold]
    assert [r.prompt_tokens for r in got] == [r.prompt_tokens for r in cold]
    for i, (p, o) in enumerate(zip(got, own)):
        assert p.cached_tokens >= o.cached_tokens, (p, o)
        if p.round == "second":   # the first turn's prompt, less exo's 2-token cut
            assert p.cached_tokens >= got[i - 1].prompt_tokens - 2, p
        if p.round == "retry":    # the same prompt again: all but the cut
            assert p.cached_tokens == p.prompt_tokens - 2, p
        if p.round == "again" and arch == "llama":   # covered by the longer second turn
            assert p.cached_tokens == o.cached_tokens == p.prompt_tokens - 1, (p, o)
    assert all(r.cached_tokens == 0 for r in cold)
    assert cache.counters["store_errors"] == cache.counters["cache_errors"] == 0
    cache.manager.close()


def test_memory_within_the_hot_budget_while_exos_own_grows(loaded, tmp_path) -> None:
    """exo's own cache grows by each conversation's copy; paged-cache's RAM tier holds at most
    its budget, and active memory stops growing once that is full."""
    model, tokenizer = loaded["llama"]
    sizes = dict(SIZES, conversations=6)
    own = play(model, tokenizer, compat.KVPrefixCache(None), **sizes)
    own_after = [r.active_bytes for r in own if r.round == "retry"]
    step = min(b - a for a, b in zip(own_after, own_after[1:]))
    budget = 256 * 1024
    assert step > budget   # each conversation's copy alone is larger than paged-cache's budget
    cache = paged(tmp_path, hot_cache_max_bytes=budget)
    got = play(model, tokenizer, cache, **sizes)
    after = [r.active_bytes for r in got if r.round == "retry"]
    assert cache.manager.stats()["hot"]["bytes"] <= budget
    assert max(after[1:]) - after[0] < step / 4, after   # flat from the first conversation on
    assert all(p.cached_tokens >= o.cached_tokens for p, o in zip(got, own))
    cache.manager.close()


@pytest.mark.parametrize("kind, hot_only", [("sequential", False), ("batch", False),
                                             ("sequential", True)])
def test_a_cancelled_prefill_loses_nothing(loaded, tmp_path, kind, hot_only) -> None:
    """exo's runner cancels a task by raising PrefillCancelled from the prefill's progress
    callback: after get_kv_cache, before any store. Every request is sent and cancelled once,
    then sent again: each reuses at least what exo's own cache reuses on the same sequence
    (blocks of 256 tokens: the partial tail a fetch hands over is most of a short prompt), with
    an SSD tier and with the RAM tier alone."""
    model, tokenizer = loaded["llama"]
    sizes = dict(SIZES, conversations=2, kind=kind, rounds=AGAIN)
    cold = play(model, tokenizer, None, **sizes)
    own = play(model, tokenizer, compat.KVPrefixCache(None), cancel=True, **sizes)
    cache = paged(tmp_path, block_size=256, hot_cache_only=hot_only)
    got = play(model, tokenizer, cache, cancel=True, **sizes)
    assert [r.reply for r in got] == [r.reply for r in own] == [r.reply for r in cold]
    assert [r.cancelled for r in got] == [r.cancelled for r in own]
    assert all(r.cancelled for r in got if r.round in ("first", "second")), got
    for p, o in zip(got, own):
        assert p.cached_tokens >= o.cached_tokens, (p, o)
    assert cache.counters["store_errors"] == cache.counters["cache_errors"] == 0
    cache.manager.close()


def test_deepseek_v4_goes_to_exos_own_cache_and_is_never_wrong(tmp_path) -> None:
    """exo's mlx-lm fork's DeepSeek-V4 builds DeepseekV4Cache, which paged-cache has no handler
    for: every request goes to exo's own cache, counted. That cache cuts a longer stored cache
    back to a shorter match with ``trim``, which DeepseekV4Cache ignores: such a restore is
    refused (counted) and the request runs uncached, so every reply equals the cold run's and
    a retry still reuses all but exo's cut."""
    model, tokenizer = load(str(deepseek_v4_dir(tmp_path / "deepseek_v4")))
    assert type(model.make_cache()[0]).__name__ == "DeepseekV4Cache"
    sizes = dict(conversations=2, system_chars=200, user_chars=300, max_tokens=6, rounds=AGAIN)
    cold = play(model, tokenizer, None, **sizes)
    cache = paged(tmp_path)
    got = play(model, tokenizer, cache, **sizes)
    assert [r.reply for r in got] == [r.reply for r in cold]
    assert all(r.cached_tokens == r.prompt_tokens - 2 for r in got if r.round == "retry"), got
    st = cache.counters
    assert st["fallbacks_layout"] == len(got) and st["requests"] == st["stores"] == 0
    assert st["fallbacks_mismatched"] >= 1   # the second conversation's first turn
    assert cache.manager.stats()["hot"]["bytes"] == 0
    cache.manager.close()


@pytest.mark.parametrize("refused, said", [
    ("exo_rs", "exo's Rust bindings (exo_rs, built from rust/exo_rs in exo's checkout) are not "
               "installed"),
    ("mlx_lm.models.deepseek_v4", "exo needs its own mlx-lm, a fork that has "
                                  "mlx_lm.models.deepseek_v4")])
def test_the_launcher_names_what_exos_environment_lacks(refused, said) -> None:
    """`paged-cache exo` where exo is installed from its repository but a part of its
    environment is not: its Rust bindings (which exo's node imports; refused by the import
    system so that no node starts where they are built) or its mlx-lm fork."""
    script = (f"import sys; sys.modules[{refused!r}] = None\n"
              "from paged_cache.cli.main import main\n"
              "sys.exit(main(['exo', '--hot-cache-only']))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(EXO_SRC) / "src"),
                                                        *sys.path]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 1, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("paged-cache exo: error: exo: cannot import ") and said in line, line
    assert "uv sync" in line and "unrelated" not in line


def test_image_requests_fall_back_to_exos_own_cache(loaded, tmp_path) -> None:
    from exo.worker.engines.mlx.vision import MediaRegion

    model, _ = loaded["llama"]
    cache = paged(tmp_path)
    tokens = mx.array(list(range(40, 140)))
    media = [MediaRegion(content_hash="a" * 64, start_pos=10, end_pos=20)]
    kv, remaining, index, exact = cache.get_kv_cache(model, tokens, media_regions=media)
    assert index is None and remaining.shape[0] == 100
    model(tokens[:-3][None], cache=kv)
    cache.add_kv_cache(tokens, kv, media_regions=media, prefill_tps=12.5)
    kv, remaining, index, exact = cache.get_kv_cache(model, tokens, media_regions=media)
    assert index == FALLBACK_BASE and exact and cache.prefill_tps[index] == 12.5
    assert cache.counters["fallbacks_media"] == 2 and cache.counters["requests"] == 0
    assert len(cache.fallback.prompts) == 1
    cache.manager.close()


def test_startup_hook_reaches_the_spawned_runner(tmp_path) -> None:
    config = CacheConfig(hot_cache_max_bytes="3MB", hot_cache_only=True)
    env = runner_environ(config, tmp_path)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            got = pool.apply_async(builder_cache_class).get(timeout=240)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert got == ("paged_cache.integrations.exo.adapter.PagedKVPrefixCache hot="
                   f"{3 * 10**6}"), got
    assert builder_cache_class() == "exo.worker.engines.mlx.cache.KVPrefixCache"


def test_the_spawned_runner_answers_its_metrics_at_the_port_plus_rank(tmp_path) -> None:
    """Under ``paged-cache exo --metrics-port``: the runner exo's builder makes its cache in
    answers /metrics on 127.0.0.1 at the port + rank 0, labelled engine="exo"; a port taken when
    the launcher starts is refused there, naming it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        port = probe.getsockname()[1]
        with pytest.raises(ServeError, match=f"--metrics-port {port}: cannot listen on"):
            runner_environ(CacheConfig(), tmp_path, metrics_port=port)
    env = runner_environ(CacheConfig(hot_cache_only=True), tmp_path, metrics_port=port)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            got = pool.apply_async(builder_cache_class).get(timeout=240)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                text = r.read().decode()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert got.startswith("paged_cache.integrations.exo.adapter.PagedKVPrefixCache"), got
    assert 'paged_cache_requests_requests_total{engine="exo",model="",rank="0"} 0.0' in text


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_sharded_by_exos_split_every_rank_exact_and_in_step(tmp_path, mode) -> None:
    """Two ranks (mlx.launch --backend ring on 127.0.0.1) split a llama by exo's own
    tensor_auto_parallel / pipeline_auto_parallel and serve through exo's mlx_generate on exo's
    group: each rank's replies equal the sharded cold run's, the ranks restore the same prefix
    (one agreement per request), nothing hangs (the launch's timeout fails the test). Each
    rank answers its metrics at the --metrics-port + its rank, labelled with that rank."""
    import json

    from paged_cache.testing.ranks import free_ports, launch

    model_dir = write_model_dir(tmp_path / "llama", "llama", printable_replies=True)
    port = free_ports(2)
    done = launch([str(Path(__file__).parent / "exo_rank.py"), mode, str(model_dir),
                   str(tmp_path / "ssd")], ranks=2, timeout=400,
                  env={"EXO_SRC": EXO_SRC, METRICS_ENV: f"127.0.0.1:{port}"})
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1], done.stdout[-3000:]
    for r in ranks:
        assert r["paged"] == r["cold"] and r["errors"] == 0
        assert r["agreements"] == len(r["cached"])
        later = [c for c, p in zip(r["cached"], r["prompt"]) if c]
        assert len(later) >= len(r["cached"]) // 2, r["cached"]
    assert ranks[0]["cached"] == ranks[1]["cached"] and ranks[0]["cold"] == ranks[1]["cold"]
    assert ranks[0]["shard"] != ranks[1]["shard"]
    for r in ranks:
        assert r["scraped"] == [f'paged_cache_requests_requests_total{{engine="exo",model="",'
                                f'rank="{r["rank"]}"}} {float(len(r["cached"]))}'], r["scraped"]

