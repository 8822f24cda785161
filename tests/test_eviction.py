"""The one eviction order (tiers/eviction.py): leaves first, least recently used first among them."""

from __future__ import annotations

import random

import pytest

from paged_cache.tiers.eviction import LeavesFirst, eviction_order

pytestmark = pytest.mark.unit


def order_of(rows: list[tuple[str, str | None, float]]) -> list[str]:
    return [key for key, _ in eviction_order([(k, p, 1, t) for k, p, t in rows])]


def test_a_chain_goes_from_its_tip_though_its_root_was_used_first():
    # a fetch touches root, middle, tip in that order: plain LRU would take the root first
    assert order_of([("root", None, 1.0), ("mid", "root", 2.0), ("tip", "mid", 3.0)]) == \
        ["tip", "mid", "root"]


def test_leaves_go_least_recently_used_first_and_a_parent_waits_for_its_last_child():
    rows = [("p", None, 1.0), ("a", "p", 5.0), ("b", "p", 2.0), ("lone", None, 3.0)]
    assert order_of(rows) == ["b", "lone", "a", "p"]


def test_rows_in_a_cycle_come_last_by_last_use():
    rows = [("x", "y", 2.0), ("y", "x", 1.0), ("leaf", None, 9.0)]
    assert order_of(rows) == ["leaf", "y", "x"]


def test_pins_and_skips_keep_a_parent_from_being_a_leaf():
    order = LeavesFirst()
    order.add("root", None, 1.0)
    order.add("kid", "root", 2.0)
    order.pin("kid")                         # an incoming child of kid
    assert order.victim() is None
    order.unpin("kid")
    assert order.victim() == "kid"
    order.skip("kid")                        # kid stays held: root is never a leaf again
    assert order.victim() is None and order.by_use() == ["root"]


def test_a_touch_moves_a_leaf_behind_the_others():
    order = LeavesFirst()
    for i, key in enumerate("abc"):
        order.add(key, None, float(i))
    order.touch("a", 10.0)
    got = []
    while (key := order.victim()) is not None:
        got.append(key)
        order.remove(key)
    assert got == ["b", "c", "a"] and len(order) == 0


def test_given_child_counts_count_children_outside_the_entries():
    """A window of rows with their child counts from the database: a row whose child is not in
    the window is no leaf; releasing that child makes it one."""
    order = LeavesFirst()
    order.add("old-root", None, 1.0, children=1)   # its child is newer, outside the window
    order.add("old-leaf", None, 2.0, children=0)
    assert order.victim() == "old-leaf"
    order.remove("old-leaf")
    assert order.victim() is None
    order.release("old-root")                      # the child went
    assert order.victim() == "old-root"


@pytest.mark.parametrize("seed", range(5))
def test_no_block_goes_before_a_block_continuing_it(seed: int):
    """Random forests: in the order, every row comes before its parent."""
    rng = random.Random(seed)
    rows = []
    for i in range(200):
        parent = f"n{rng.randrange(i)}" if i and rng.random() < 0.8 else None
        rows.append((f"n{i}", parent, rng.random()))
    position = {key: n for n, key in enumerate(order_of(rows))}
    assert len(position) == len(rows)
    assert all(position[key] < position[parent] for key, parent, _ in rows if parent)
