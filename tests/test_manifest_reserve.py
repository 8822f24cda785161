"""The manifest's reservation: room is made from complete rows only, and a reservation that cannot
get room evicts nothing ("full")."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.tiers.ssd.manifest import COMPLETE, RESERVED, Deferred, Manifest, Row

pytestmark = pytest.mark.unit


def row(key: str, state: int, size: int, when: float, writer: str = "w1",
        parent: str | None = None) -> Row:
    return Row(key=key, state=state, compression="none", file_bytes=size, raw_bytes=size,
               tokens=None, fingerprint=None, parent=parent, layers=None, start=None,
               token_ids=None, checkpoint=None, restorable=None, created=when,
               last_access=when, writer=writer, first_token=None)


def reserve(m: Manifest, r: Row, max_bytes: int, removed: list[str]):
    return m.reserve(r, max_bytes, Deferred({}, set()), lambda k: removed.append(k) or True,
                     lambda k: k not in removed)


def test_reservations_in_flight_are_not_room(tmp_path: Path):
    m = Manifest(tmp_path / "manifest.sqlite")
    try:
        m.adopt([row("done", COMPLETE, 100, 1.0)])
        assert reserve(m, row("flight", RESERVED, 300, 2.0, writer="w2"), 1000, [])[0] == "reserved"
        removed: list[str] = []
        # 400 used + 800 is 200 over: the complete row's 100 would not be enough and the
        # reservation's 300 cannot be evicted: refused, and nothing is evicted for it
        assert reserve(m, row("big", RESERVED, 800, 3.0), 1000, removed) == ("full", [])
        assert removed == [] and m.totals() == (2, 400)
        # 650 is 50 over: it fits once the complete row goes
        assert reserve(m, row("fits", RESERVED, 650, 4.0), 1000, removed) == \
            ("reserved", [("done", 100)])
        assert removed == ["done"] and m.totals() == (2, 950)
    finally:
        m.close()


def steps_of_a_full_reserve(path: Path, rows: int) -> int:
    """SQLite VM steps of one reservation that evicts, over ``rows`` complete rows."""
    m = Manifest(path)
    try:
        m.adopt([row(f"r{i:06d}", COMPLETE, 10, float(i)) for i in range(rows)])
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0
        m._db.set_progress_handler(count, 1)
        status, victims = reserve(m, row("new", RESERVED, 10, float(rows)), rows * 10, [])
        m._db.set_progress_handler(None, 1)
        assert (status, victims) == ("reserved", [("r000000", 10)])
        return steps[0]
    finally:
        m.close()


def test_a_write_to_a_full_tier_costs_the_same_however_many_rows_it_holds(tmp_path: Path):
    # every write to a full SSD tier reserves; reading every row there made a write's cost grow
    # with the tier (~2.7 ms at 2,000 rows, ten times that at 20,000)
    small = steps_of_a_full_reserve(tmp_path / "small.sqlite", 500)
    large = steps_of_a_full_reserve(tmp_path / "large.sqlite", 5_000)
    assert large < 1.2 * small, (small, large)


def test_a_block_never_evicts_its_own_ancestors_and_is_refused_when_only_they_are_left(
        tmp_path: Path):
    m = Manifest(tmp_path / "manifest.sqlite")
    try:
        # a chain a <- b <- c and an older lone leaf x fill the budget
        m.adopt([row("x", COMPLETE, 100, 0.5), row("a", COMPLETE, 100, 1.0),
                 row("b", COMPLETE, 100, 2.0, parent="a"),
                 row("c", COMPLETE, 100, 3.0, parent="b")])
        removed: list[str] = []
        # c's child: the other leaf goes, never c (the tip, its parent, and the only leaf next)
        assert reserve(m, row("d", RESERVED, 100, 4.0, parent="c"), 400, removed) == \
            ("reserved", [("x", 100)])
        m.mark_complete(["d"])
        # d's child: only its ancestors are left, so it is refused and the chain stays whole
        assert reserve(m, row("e", RESERVED, 100, 5.0, parent="d"), 400, removed) == \
            ("full", [])
        assert removed == ["x"] and m.totals() == (4, 400)
        # a block of another chain still evicts this one from its tip
        assert reserve(m, row("y", RESERVED, 100, 6.0), 400, removed) == \
            ("reserved", [("d", 100)])
    finally:
        m.close()


def chain_manifest(path: Path, n: int) -> Manifest:
    """A manifest holding one chain of ``n`` rows c0 <- c1 <- ..., touched root first, full at
    ``n * 10`` bytes."""
    m = Manifest(path)
    m.adopt([row(f"c{i:04d}", COMPLETE, 10, 1.0 + i, parent=f"c{i - 1:04d}" if i else None)
             for i in range(n)])
    return m


def test_a_long_chain_is_read_once_while_its_tip_goes_write_after_write(tmp_path: Path):
    m = chain_manifest(tmp_path / "manifest.sqlite", 200)
    try:
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0
        m._db.set_progress_handler(count, 1)
        spent = []
        for i in range(4):
            before = steps[0]
            status, victims = reserve(m, row(f"new{i}", RESERVED, 10, 500.0 + i), 2000, [])
            spent.append(steps[0] - before)
            assert (status, victims) == ("reserved", [(f"c{199 - i:04d}", 10)])
        m._db.set_progress_handler(None, 1)
        # the first reads the chain (200 rows, their child counts), the others only evict
        assert max(spent[1:]) * 5 < spent[0], spent
    finally:
        m.close()


def test_another_connection_s_write_is_seen_by_the_next_eviction(tmp_path: Path):
    m = chain_manifest(tmp_path / "manifest.sqlite", 100)
    other = Manifest(tmp_path / "manifest.sqlite")   # as another process would
    try:
        assert reserve(m, row("a", RESERVED, 10, 500.0), 1000, []) == \
            ("reserved", [("c0099", 10)])
        other.adopt([row("old", COMPLETE, 10, 0.5)])   # the least recently used leaf now
        assert reserve(m, row("b", RESERVED, 10, 501.0), 1000, [])[1] == \
            [("old", 10), ("c0098", 10)]
        assert reserve(m, row("c", RESERVED, 10, 502.0), 1000, [])[1] == [("c0097", 10)]
    finally:
        other.close()
        m.close()


def test_a_reservation_whose_file_went_before_it_completed_is_dropped(tmp_path: Path):
    """A writer renames its file in, then completes its reservation; a process that discards
    the block in between removes the file, and its own row removal keeps a reservation. The
    completion checks the file inside its transaction: gone, the reservation goes too (no row
    without a file); there, the row is complete."""
    m = Manifest(tmp_path / "manifest.sqlite")
    try:
        for key in ("kept", "discarded"):
            assert reserve(m, row(key, RESERVED, 100, 1.0), 1000, [])[0] == "reserved"
        assert m.complete("kept", "w1", lambda k: True)
        assert not m.complete("discarded", "w1", lambda k: False)
        assert m.totals() == (1, 100) and m.complete_keys() == {"kept"}
    finally:
        m.close()
