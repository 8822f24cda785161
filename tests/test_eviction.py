"""The one eviction order (tiers/eviction.py): leaves first, least recently used first among them."""

from __future__ import annotations

import random

import pytest

from paged_cache.tiers.eviction import (ORDERS, Frequency, LeavesFirst, NewestFirst, ReusedLast,
                                        ReusedLater, Turns, eviction_order)

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


def drain(order: LeavesFirst) -> list[str]:
    got = []
    while (key := order.victim()) is not None:
        got.append(key)
        order.remove(key)
    return got


def test_reused_last_takes_leaves_used_once_first():
    order = ReusedLast()
    for i, key in enumerate(("old", "once", "new")):
        order.add(key, None, float(i))
    order.touch("old", 5.0)                  # used again: it outlives leaves used once
    assert drain(order) == ["once", "new", "old"]


def test_ghosts_count_a_block_stored_again_after_its_eviction_as_reused():
    order = ReusedLast(ghosts=4)
    order.add("back", None, 1.0)
    order.remove("back")                     # evicted ...
    order.add("fresh", None, 2.0)
    order.add("back", None, 3.0)             # ... and stored again: reused
    assert drain(order) == ["fresh", "back"]
    assert drain(ReusedLast()) == []


def test_reused_later_keeps_a_reused_leaf_for_a_while_then_lets_it_go():
    order = ReusedLater(credit=1.0)
    order.add("once", None, 1.0)
    order.add("reused", None, 2.0)
    order.add("newer", None, 3.0)
    order.touch("reused", 4.0)               # ranks as used at 4 + 1 x 3 entries = 7
    order.add("latest", None, 8.0)
    assert drain(order) == ["once", "newer", "reused", "latest"]


def test_frequency_turns_and_newest_first_keep_the_leaves_first_rule():
    freq = Frequency()
    freq.add("a", None, 1.0)
    freq.add("b", None, 2.0)
    freq.touch("a", 3.0)
    freq.touch("a", 4.0)
    assert drain(freq) == ["b", "a"]
    turns = Turns()
    turns.add("chat", None, 1.0)
    for t in (2.0, 3.0, 4.0):
        turns.touch("chat", t)               # three more turns through the chat's prefix
    turns.add("chat-tip", "chat", 5.0)
    turns.add("one-shot", None, 6.0)         # a newer prompt nobody continued
    assert drain(turns) == ["one-shot", "chat-tip", "chat"]
    newest = NewestFirst()
    newest.add("root", None, 1.0)
    newest.add("tip", "root", 2.0)
    newest.add("other", None, 3.0)
    assert drain(newest) == ["other", "tip", "root"]


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_order_evicts_a_child_before_its_parent(name: str):
    rng = random.Random(7)
    order = ORDERS[name]()
    parents: dict[str, str | None] = {}
    for i in range(150):
        parent = f"n{rng.randrange(i)}" if i and rng.random() < 0.8 else None
        parents[f"n{i}"] = parent
        order.add(f"n{i}", parent, float(i))
        if rng.random() < 0.3:
            order.touch(f"n{rng.randrange(i + 1)}", 1000.0 + i)
    gone: set[str] = set()
    for key in drain(order):
        assert not any(p == key and k not in gone for k, p in parents.items())
        gone.add(key)
    assert len(gone) == 150
