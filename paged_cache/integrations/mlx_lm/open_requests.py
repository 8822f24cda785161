"""The requests ``PagedPromptCache`` has fetched for and not yet finished (``OpenRequests``):
what its inserts are attributed to, and what a request's time to first token is filed under."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

# Requests fetched and not yet finished by their "assistant" insert (a request the client dropped
# never gets one): beyond this many, the oldest is logged and forgotten.
MAX_OPEN_REQUESTS = 256


@dataclass(eq=False)   # compared by identity: two requests may carry equal fields
class Request:
    """One request between its fetch and its final ("assistant") insert, for its log line."""

    tokens: list[int]
    cached: int
    tier: str
    fetch_seconds: float
    salt: str | None = None
    store_seconds: float = 0.0
    stores: int = 0
    store_failed: bool = False

    def covers(self, tokens: list[int], final: bool) -> bool:
        """True when an insert of `tokens` belongs to this request: the final insert extends the
        prompt (prompt + reply); a segment insert is a prefix of it."""
        if final:
            return len(tokens) >= len(self.tokens) and tokens[:len(self.tokens)] == self.tokens
        return len(tokens) <= len(self.tokens) and self.tokens[:len(tokens)] == tokens


class OpenRequests:
    """The open requests, oldest first (at most MAX_OPEN_REQUESTS), and the last as many that
    closed: a server's HTTP thread counts a request's first token after its generation thread
    may have finished the request (a short reply's final insert comes first). Not locked: the
    owner's lock guards it."""

    def __init__(self) -> None:
        self._open: list[Request] = []
        self._closed: deque[Request] = deque(maxlen=MAX_OPEN_REQUESTS)

    def __len__(self) -> int:
        return len(self._open)

    def add(self, request: Request) -> Request | None:
        """Open ``request``; the oldest open one, closed to make room, or None."""
        self._open.append(request)
        return self.close(self._open[0]) if len(self._open) > MAX_OPEN_REQUESTS else None

    def close(self, request: Request) -> Request:
        """Close the open ``request``; return it."""
        self._open.remove(request)
        self._closed.append(request)
        return request

    def matching(self, tokens: list[int], final: bool) -> list[Request]:
        """The open requests an insert of ``tokens`` (``final``: the "assistant" one) may belong
        to, oldest first."""
        return [r for r in self._open if r.covers(tokens, final)]

    def fetched(self, prompt: list[int]) -> Request | None:
        """The newest request, open or just closed, whose fetch was ``prompt`` (or a prefix of
        it), or None."""
        return next((r for r in itertools.chain(reversed(self._open), reversed(self._closed))
                     if r.covers(prompt, final=True)), None)
