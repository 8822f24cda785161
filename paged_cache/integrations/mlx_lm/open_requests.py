"""The requests ``PagedPromptCache`` has fetched for and not yet finished (``OpenRequests``):
what its inserts are attributed to, and what a request's time to first token is filed under."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

# Requests fetched and not yet finished by their "assistant" insert (a request the client dropped
# never gets one): beyond this many, the oldest is logged and forgotten.
MAX_OPEN_REQUESTS = 256
# Requests finished before their first token was counted (a short reply's final insert can come
# before the server's HTTP thread reads its first token), each kept until it is: at most this
# many, the oldest forgotten (a client gone before its first token).
MAX_CLOSED_REQUESTS = 64


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
    first_token: bool = False  # its first token was counted

    def covers(self, tokens: list[int], final: bool) -> bool:
        """True when an insert of `tokens` belongs to this request: the final insert extends the
        prompt (prompt + reply); a segment insert is a prefix of it."""
        if final:
            return len(tokens) >= len(self.tokens) and tokens[:len(self.tokens)] == self.tokens
        return len(tokens) <= len(self.tokens) and self.tokens[:len(tokens)] == tokens


class OpenRequests:
    """The open requests, oldest first (at most MAX_OPEN_REQUESTS), and those closed before
    their first token was counted (at most MAX_CLOSED_REQUESTS), each kept until it is. Not
    locked: the owner's lock guards it."""

    def __init__(self) -> None:
        self._open: list[Request] = []
        self._closed: deque[Request] = deque(maxlen=MAX_CLOSED_REQUESTS)

    def __len__(self) -> int:
        return len(self._open)

    def add(self, request: Request) -> Request | None:
        """Open ``request``; the oldest open one, closed to make room, or None."""
        self._open.append(request)
        return self.close(self._open[0]) if len(self._open) > MAX_OPEN_REQUESTS else None

    def close(self, request: Request) -> Request:
        """Close the open ``request``; return it."""
        self._open.remove(request)
        if not request.first_token:
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

    def first_token(self, prompt: list[int]) -> Request | None:
        """``fetched(prompt)``, its first token now counted: a closed one is let go."""
        found = self.fetched(prompt)
        if found is not None:
            found.first_token = True
            if found in self._closed:
                self._closed.remove(found)
        return found
