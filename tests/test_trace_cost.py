"""The trace's cost replay (benchmarks/trace_cost.py): with a full SSD tier (``ssd full``), past a
third of the replay's blocks every write evicts, the writer's CPU time and writes are filed per
request, and its figures compare a window of writes that evict with one before the tier is full;
in every configuration with an SSD tier, a request finds the writer caught up (its blocks in
files, not in the write queue), as at the trace's own pace, a take of a block file costs
more than its read floor, and each request's steps are timed."""

from __future__ import annotations

from pathlib import Path

from benchmarks import trace_cost, trace_stream

REQUESTS = 80


def test_a_full_ssd_tier_evicts_and_its_writer_is_measured(tmp_path: Path) -> None:
    requests = trace_stream.load(limit=REQUESTS)
    chains = trace_cost.Chains()
    total = len({k for r in requests for k, _ in chains.of(r)})
    run = trace_cost.replay("ssd full", requests, chains, tmp_path, total)
    assert run.full_blocks == total // trace_cost.FULL_SHARE
    assert len(run.writer) == REQUESTS
    cpu, written, evicted = zip(*run.writer)
    assert list(cpu) == sorted(cpu) and list(written) == sorted(written)   # totals so far
    assert written[-1] >= total and evicted[-1] >= total - run.full_blocks
    marks = [run.held[1], run.held[REQUESTS - 10]]   # after the first request, near the end
    (before, after) = trace_cost.writer_figures(run, marks, window=5)
    assert before.details["evictions"] == 0 and after.details["evictions"] > 0
    assert before.measured > 0 and after.ratio == after.measured / before.measured


def test_each_request_finds_the_ssd_writer_caught_up(tmp_path: Path) -> None:
    requests = trace_stream.load(limit=6)
    requests += requests[:1]   # the first again, once the 64-block RAM tier has moved on
    chains = trace_cost.Chains()
    total = len({k for r in requests for k, _ in chains.of(r)})
    run = trace_cost.replay("ssd", requests, chains, tmp_path, total)
    assert run.counters["ssd_hits"] >= 20            # taken from their files
    assert run.counters["ssd_pending_hits"] == 0     # never from the write queue
    assert sum(run.file_takes) == run.counters["ssd_hits"] and run.file_takes[-1] > 0
    # a take through the manager does its read floor's work and more
    assert run.floor_files > 0 and run.take_s > run.floor_s > 0
    # each request's steps are timed within its time; its takes only while it takes blocks
    for seconds, phases, took in zip(run.seconds, run.phases, run.file_takes):
        assert len(phases) == len(trace_cost.PHASES) and min(phases) >= 0
        assert sum(phases) <= seconds and phases[0] > 0 and phases[3] > 0
        assert took == 0 or phases[1] > 0
    # the p99 figure names its request's blocks, steps and file blocks' floor; the p99 table
    # puts them in a row, with the request's cost were each file take only its floor
    p99 = next(f for f in trace_cost.cost_figures(run, [run.held[0]], window=len(requests))
               if f.name.startswith("cost per request p99"))
    d = p99.details
    assert set(d["p99_phases_s"]) == set(trace_cost.PHASES)
    assert sum(d["p99_phases_s"].values()) <= d["p99_s"] and d["p99_blocks"] > 0
    assert d["p99_floor_s"] == d["p99_file_blocks"] * run.floor_s
    row = trace_cost.p99_table([p99.to_dict()]).splitlines()[2].split(" | ")
    at_floor = d["p99_s"] - d["p99_phases_s"]["takes"] + d["p99_floor_s"]
    assert row[0] == "| `ssd`" and row[-1] == f"{at_floor * 1e3:.1f} ms |"
