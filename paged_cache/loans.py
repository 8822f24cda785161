"""Loans: blocks a hot-only fetch handed over, given back only where the holder kept them.

With no SSD tier a block handed to a request (its arrays become the live cache's rows) exists
nowhere else. The prefix cache records each lent block's meta and a digest of its arrays, and
keeps the cache's layers until a store holds those blocks again (the request's own inserts). It
gives a loan back early, when another request wants that prefix, when the holder dropped the
cache list (a weak reference says so), or past ``MAX_LOANS`` open loans: the lent spans are cut
again from the live layers and each block whose cut has the lent digest is put back, in chain
order up to the first that does not. Rows the holder trimmed away, rewrote after a trim or
changed in place are never given back; those blocks are counted lost. The second copy exists
only while two requests really share the prefix.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import xxhash

from paged_cache.hashing import shared_prefix
from paged_cache.tiers.format import raw_tensors

logger = logging.getLogger("paged_cache.loans")

MAX_LOANS = 64


def digest(block: Any) -> bytes:
    """xxh3-128 of a block's arrays: names, dtypes, shapes and bytes, in name order."""
    h = xxhash.xxh3_128()
    for name, (dtype, shape, view) in sorted(raw_tensors(block).items()):
        h.update(f"{name}:{dtype}:{shape};".encode())
        h.update(view)
    return h.digest()


@dataclass(frozen=True)
class Lent:
    """One block handed over: what it held (``digest``) for tokens ``[start, end)``."""

    key: str
    start: int
    end: int
    meta: dict[str, str]
    digest: bytes

    @classmethod
    def of(cls, block: Any, start: int, end: int) -> "Lent":
        """The record of ``block`` (its arrays still in place) lent for ``[start, end)``."""
        return cls(block.key, start, end, dict(block.meta), digest(block))


class LentCache(list):
    """The cache list a fetch lends blocks to: a plain list that can be weakly referenced, so
    the loan notices when its holder drops it."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False)
class Loan:
    """Blocks handed over to the layers ``layers`` of a cache list positioned past ``tokens``."""

    tokens: np.ndarray
    layers: list
    blocks: list[Lent]
    holder: weakref.ref

    @property
    def keys(self) -> list[str]:
        return [b.key for b in self.blocks]


GiveBack = Callable[[list, list[Lent]], int]   # (layers, lent blocks) -> blocks put back


class Loans:
    """Open loans, oldest first; ``give_back(layers, blocks)`` puts back the blocks the layers
    still hold unchanged (a prefix of ``blocks``) and says how many."""

    def __init__(self, give_back: GiveBack) -> None:
        self._open: OrderedDict[int, Loan] = OrderedDict()
        self._give_back = give_back
        self._next = 0
        self.counters = dict(loans=0, loans_returned=0, loans_settled=0, loans_lost=0,
                             loan_blocks_returned=0, loan_blocks_lost=0)

    def lend(self, tokens: np.ndarray, cache: list, blocks: list[Lent]) -> LentCache:
        """Record that ``blocks`` went to ``cache`` (covering ``tokens``); returns the list to
        hand to the caller (the same entries)."""
        held = LentCache(cache)
        self._open[self._next] = Loan(np.array(tokens), list(cache), list(blocks), weakref.ref(held))
        self._next += 1
        self.counters["loans"] += 1
        while len(self._open) > MAX_LOANS:
            self._return(next(iter(self._open)))
        return held

    def settle(self, held: Callable[[list[str]], bool], wanted: np.ndarray | None = None,
               stored: np.ndarray | None = None) -> None:
        """Close loans whose tokens a store (``stored``) covered or whose blocks are held again;
        give back the ones another request wants (it shares tokens with ``wanted``) and the ones
        whose holder dropped the cache list."""
        for key, loan in list(self._open.items()):
            mine = loan.tokens
            if (stored is not None and shared_prefix(mine, stored) == len(mine)) or held(loan.keys):
                del self._open[key]
                self.counters["loans_settled"] += 1
            elif (wanted is not None and shared_prefix(mine, wanted) > 0) or loan.holder() is None:
                self._return(key)

    def _return(self, key: int) -> None:
        loan = self._open.pop(key)
        try:
            back = self._give_back(loan.layers, loan.blocks)
        except Exception:  # noqa: BLE001 - a layer the holder broke: its blocks are lost
            logger.warning("a loan of %d blocks could not be cut again", len(loan.blocks),
                           exc_info=True)
            back = 0
        lost = len(loan.blocks) - back
        c = self.counters
        c["loan_blocks_returned"] += back
        c["loan_blocks_lost"] += lost
        c["loans_lost" if lost else "loans_returned"] += 1
        if lost:
            logger.info("loan given back: %d of %d blocks unchanged, %d lost (the holder trimmed "
                        "or rewrote their rows)", back, len(loan.blocks), lost)

    def __len__(self) -> int:
        return len(self._open)
