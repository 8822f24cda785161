"""Helpers shared by the tenant tests of every server (no tests here): `paged-cache serve`
(tests/test_serve_trust.py) and the engines (tests/engines). A private text is sent by tenants
named by a cache salt (body field or header) or, with --cache-salt-from-user, by the OpenAI
`user` field; each check says what each request may reuse."""

from __future__ import annotations

from typing import Any, Callable

import pytest

# One long private text: the blocks a second tenant must never get (about 1,000 tokens).
PRIVATE = " ".join(f"Clause {i}: the tenant's private figure is {i * 7919 % 1000}." for i in range(90))

Ask = Callable[..., tuple[int, int]]
"""ask(salt=, header=, user=) -> (cached prompt tokens, prompt tokens) of one request."""


def chat_ask(client: Any, model: str, cached: Callable[[Any], int | None] | None = None,
             **fixed: Any) -> Ask:
    """``ask`` sending the private text as one greedy chat completion of ``model``;
    ``cached(usage)`` reads its cached tokens (default: the usage's ``prompt_tokens_details``);
    ``fixed``: more request fields. Each check runs on a server of its own: any two chat
    prompts share their first tokens, which the unsalted space of one server would reuse."""
    messages = [{"role": "user", "content": PRIVATE + " Summarize."}]

    def ask(*, salt: str | None = None, header: str | None = None,
            user: str | None = None) -> tuple[int, int]:
        r = client.chat.completions.create(
            model=model, messages=messages, temperature=0.0, max_tokens=4,
            extra_body={} if salt is None else {"cache_salt": salt},
            extra_headers={} if header is None else {"X-Cache-Salt": header},
            **({} if user is None else {"user": user}), **fixed)
        hit = r.usage.prompt_tokens_details.cached_tokens if cached is None else cached(r.usage)
        return hit, r.usage.prompt_tokens

    return ask


def check_salts(ask: Ask) -> None:
    """A salted tenant reuses only its own prefix: salt a stores it, salt b and no salt reuse 0
    tokens of it; the unsalted repeat and salt a again reuse all of it (as the header names the
    same tenant as the field); bad salts are refused with HTTP 400 naming ``cache_salt``."""
    import openai

    first, prompt_tokens = ask(salt="tenant-a")
    assert first == 0 and prompt_tokens > 900
    assert ask(salt="tenant-b")[0] == 0                  # another salt: nothing
    assert ask()[0] == 0                                 # no salt: nothing either
    everything = ask()[0]                                # the unsalted repeat
    assert everything >= prompt_tokens - 16
    assert ask(salt="tenant-a")[0] == everything         # a's own, all of it
    assert ask(header="tenant-b")[0] == everything       # header = body field
    assert ask(salt="tenant-c", header="tenant-c")[0] == 0
    for bad in ({"salt": ""}, {"salt": 5}, {"salt": "x", "header": "y"}):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            ask(**bad)


def check_user_salts(ask: Ask) -> None:
    """With --cache-salt-from-user: two users reuse nothing of each other's, a user reuses its
    own, a request without a user is in the shared space, and an explicit salt wins."""
    assert ask(user="alice")[0] == 0
    assert ask(user="bob")[0] == 0
    alice = ask(user="alice")[0]
    assert alice > 900
    assert ask()[0] == 0                                 # no user: the shared space
    assert ask(user="bob", salt="alice")[0] == alice     # an explicit salt wins
