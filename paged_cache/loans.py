"""Loans: blocks a hot-only fetch handed over, and how the store gets them back.

With no SSD tier a block handed to a request (its arrays become the live cache's rows) exists
nowhere else. The prefix cache keeps the returned cache list until a store holds those blocks
again (the request's own inserts), and returns a loan early, cutting the blocks again from the
live cache (whose rows ``[0, n)`` an append-only KV layer never changes), when another request
needs that prefix meanwhile, when the holder dropped the cache without storing it, or when more
than ``MAX_LOANS`` are open. Nothing fetched is lost, and concurrent requests for one prefix all
hit; the second copy exists only while two requests really share the prefix.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from paged_cache.chain_index import shared_prefix

logger = logging.getLogger("paged_cache.loans")

MAX_LOANS = 64
_HELD_BY_US = 2  # sys.getrefcount of a list only the loan holds (the loan + the call's argument)


@dataclass
class Loan:
    """Blocks ``keys`` handed over to the cache list ``cache`` positioned past ``tokens``."""

    tokens: np.ndarray
    cache: list
    keys: list[str]


class Loans:
    """Open loans, oldest first; ``give_back(loan)`` stores a loan's tokens from its live cache."""

    def __init__(self, give_back: Callable[[Loan], None]) -> None:
        self._open: OrderedDict[int, Loan] = OrderedDict()
        self._give_back = give_back
        self.counters = dict(loans=0, loans_returned=0, loans_settled=0, loans_lost=0)

    def lend(self, tokens: np.ndarray, cache: list, keys: list[str]) -> None:
        """Record that ``keys`` went to ``cache`` (covering ``tokens``)."""
        self._open[id(cache)] = Loan(np.array(tokens), cache, list(keys))
        self.counters["loans"] += 1
        while len(self._open) > MAX_LOANS:
            self._return(next(iter(self._open)))

    def settle(self, held: Callable[[list[str]], bool], wanted: np.ndarray | None = None,
               stored: np.ndarray | None = None) -> None:
        """Close loans whose tokens a store (``stored``) covered or whose blocks are held again;
        return the ones another request wants (it shares tokens with ``wanted``) and the ones
        whose holder dropped the cache unstored."""
        for key, loan in list(self._open.items()):
            mine = loan.tokens
            if (stored is not None and shared_prefix(mine, stored) == len(mine)) or held(loan.keys):
                del self._open[key]
                self.counters["loans_settled"] += 1
            elif (wanted is not None and shared_prefix(mine, wanted) > 0) \
                    or sys.getrefcount(loan.cache) <= _HELD_BY_US:
                self._return(key)

    def _return(self, key: int) -> None:
        loan = self._open.pop(key)
        if any(layer is None for layer in loan.cache):  # consumed by a store meanwhile
            self.counters["loans_settled"] += 1
            return
        try:
            self._give_back(loan)
            self.counters["loans_returned"] += 1
        except Exception:  # the live cache moved below the loan (trimmed): those blocks are gone
            self.counters["loans_lost"] += 1
            logger.warning("a loan of %d blocks could not be given back", len(loan.keys),
                           exc_info=True)

    def __len__(self) -> int:
        return len(self._open)
