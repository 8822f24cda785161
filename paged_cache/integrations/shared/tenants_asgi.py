"""Tenants of an ASGI (FastAPI) engine: ``SaltMiddleware`` reads each POST request's cache salt
(``tenants.request_salt``: the ``cache_salt`` body field, the ``X-Cache-Salt`` header, with
``from_user`` the OpenAI ``user`` field), answers HTTP 400 to a salt that is not valid (or to any
salt, while ``refusal`` says the engine cannot honour one), and runs the engine's handling of the
request with ``tenants.CURRENT_SALT`` set to it.

Plain ASGI (no framework import): the engines paged-cache plugs into (vllm-mlx,
mlx-openai-server) are FastAPI applications, and a context variable set here is seen by the
endpoint and by every task it starts.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from paged_cache.integrations.shared.tenants import (CURRENT_SALT, SALT_FIELD, SALT_HEADER, SaltError,
                                                     error_body, request_salt)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_TYPE = b"application/json"


class SaltMiddleware:
    """``app`` with each POST request's cache salt in ``CURRENT_SALT`` while it is handled.

    A body the engine reads as JSON is read whole (as the engine does) and handed on unchanged;
    any other body (uploads, forms) is streamed through and only the header names a salt.
    Requests of other methods and other scopes (lifespan) pass through untouched."""

    def __init__(self, app: ASGIApp, *, from_user: bool = False,
                 refusal: Callable[[], str | None] = lambda: None) -> None:
        self.app = app
        self.from_user = from_user
        self.refusal = refusal   # why salts cannot be honoured (asked per request), or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        body = await _read_body(receive) if _may_be_json(headers) else None
        header = headers.get(SALT_HEADER.lower())
        try:
            salt = request_salt(body, {} if header is None else {SALT_HEADER: header},
                                from_user=self.from_user)
            reason = self.refusal() if salt is not None else None
            if reason is not None:
                raise SaltError(f"{SALT_FIELD}: {reason}")
        except SaltError as error:
            await _answer_400(send, error_body(error))
            return
        token = CURRENT_SALT.set(salt)
        try:
            await self.app(scope, receive if body is None else _replay(body, receive), send)
        finally:
            CURRENT_SALT.reset(token)


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (ASGI's spelling), the first of each."""
    out: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def _may_be_json(headers: dict[str, str]) -> bool:
    """Whether FastAPI would read the body as JSON: no content type, or application/json or
    application/*+json (a body it reads so may carry the salt field)."""
    kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or (kind.startswith("application/")
                                                     and kind.endswith("+json"))


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (ASGI ``http.request`` messages until ``more_body`` is false)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":   # the client went away
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands ``body`` over once, then waits on the client as ``receive``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer_400(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", JSON_TYPE),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
