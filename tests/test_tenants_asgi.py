"""SaltMiddleware, the salt reader of the ASGI engines (vllm-mlx, mlx-openai-server), called
with ASGI messages as a server sends them: the salt it makes current while the engine handles
the request, the body the engine then reads, and its 400 answers. The engines themselves run it
in tests/engines (`make test-engines`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from paged_cache.integrations.shared.tenants import CURRENT_SALT, SALT_FIELD
from paged_cache.integrations.shared.tenants_asgi import SaltMiddleware

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Engine:
    """An ASGI app that reads the whole body, as FastAPI does, and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        self.seen.append((CURRENT_SALT.get(), body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(body: bytes, *, headers: dict[str, str] | None = None, method: str = "POST",
         content_type: str | None = "application/json", from_user: bool = False,
         chunk: int = 0, refusal: str | None = None) -> tuple[Engine, list[dict]]:
    """One request through SaltMiddleware(Engine()); the body in messages of ``chunk`` bytes
    (0: one message). Returns the engine and the messages sent back."""
    engine, sent = Engine(), []
    names = dict(headers or {})
    if content_type is not None:
        names["Content-Type"] = content_type
    scope = {"type": "http", "method": method, "path": "/v1/chat/completions",
             "headers": [(k.lower().encode(), v.encode()) for k, v in names.items()]}
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
                for i, p in enumerate(parts)]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    middleware = SaltMiddleware(engine, from_user=from_user, refusal=lambda: refusal)
    asyncio.run(middleware(scope, receive, send))
    return engine, sent


def request(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [], **fields}).encode()


def test_the_salt_is_current_while_the_engine_handles_the_request() -> None:
    body = request(cache_salt="tenant-a")
    engine, sent = call(body, chunk=7)
    assert engine.seen == [("tenant-a", body)]     # the engine reads the same body
    assert sent[0]["status"] == 200 and CURRENT_SALT.get() is None
    assert call(request(), headers={"X-Cache-Salt": "tenant-b"})[0].seen[0][0] == "tenant-b"
    assert call(request(), headers={"x-cache-salt": "tenant-b"})[0].seen[0][0] == "tenant-b"
    assert call(request())[0].seen[0][0] is None


def test_the_user_field_is_the_salt_only_when_asked() -> None:
    assert call(request(user="alice"))[0].seen[0][0] is None
    assert call(request(user="alice"), from_user=True)[0].seen[0][0] == "alice"
    assert call(request(user="alice", cache_salt="s"), from_user=True)[0].seen[0][0] == "s"


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8",
                                          "application/vnd.api+json"])
def test_every_body_the_engine_reads_as_json_is_read(content_type: str | None) -> None:
    """FastAPI reads a body without a content type, or of a JSON type, as JSON: its field
    counts."""
    engine, _ = call(request(cache_salt="tenant-a"), content_type=content_type)
    assert engine.seen[0][0] == "tenant-a"


def test_other_bodies_stream_through_and_only_the_header_counts() -> None:
    body = b"--x\r\ncache_salt=tenant-a\r\n--x--"
    engine, _ = call(body, content_type="multipart/form-data; boundary=x", chunk=4,
                     headers={"X-Cache-Salt": "tenant-b"})
    assert engine.seen == [("tenant-b", body)]


@pytest.mark.parametrize("fields, headers", [
    ({SALT_FIELD: ""}, {}),
    ({SALT_FIELD: 5}, {}),
    ({SALT_FIELD: "x" * 1025}, {}),
    ({SALT_FIELD: "x"}, {"X-Cache-Salt": "y"}),
    ({}, {"X-Cache-Salt": ""}),
])
def test_a_bad_salt_is_answered_400_and_never_reaches_the_engine(fields: dict,
                                                                 headers: dict) -> None:
    engine, sent = call(request(**fields), headers=headers)
    assert engine.seen == []
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == SALT_FIELD and SALT_FIELD in error["message"]


def test_an_engine_that_cannot_honour_salts_refuses_salted_requests() -> None:
    """While ``refusal`` names a reason, a request naming a salt gets 400 with it; an unsalted
    one is served."""
    reason = "this server's model runs on a path whose cache knows no cache salt"
    engine, sent = call(request(cache_salt="tenant-a"), refusal=reason)
    assert engine.seen == [] and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"] == f"{SALT_FIELD}: {reason}"
    engine, sent = call(request(user="alice"), refusal=reason)
    assert engine.seen == [(None, request(user="alice"))] and sent[0]["status"] == 200


def test_other_methods_and_scopes_pass_through() -> None:
    engine, sent = call(b"", method="GET", headers={"X-Cache-Salt": ""})
    assert engine.seen == [(None, b"")] and sent[0]["status"] == 200
    engine, sent = Engine(), []

    async def lifespan() -> None:
        async def send(message: dict) -> None:
            sent.append(message)
        await SaltMiddleware(engine)({"type": "lifespan"}, None, send)

    asyncio.run(lifespan())
    assert engine.seen == [(None, b"")]
