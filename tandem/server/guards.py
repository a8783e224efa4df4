"""Guards in front of every route of an app: the API key and the request body's size.

Plain ASGI middleware, not Starlette's BaseHTTPMiddleware (which hides client disconnects
from the handler, and a disconnect must abort the request). Refusals are in OpenAI's error
schema (``tandem.server.errors``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.errors import error_response

MIB = 1 << 20
# The default body limit: room for a prompt of max_model_len tokens written out the longest
# usual way (JSON-escaped non-ASCII text, about 24 bytes a token; token ids, at most 8),
# with the rest of the request, and never under a few MiB.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 4 * MIB


def default_max_body_bytes(max_model_len: int) -> int:
    """The body size limit for an engine of ``max_model_len`` tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


class ApiKeyGuard:
    """Refuses (401) every HTTP request that lacks ``Authorization: Bearer <api_key>``,
    except to the paths in ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                refusal = error_response(401, "invalid or missing API key", "authentication_error")
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """A request body over the limit (raised while it is read: a 413 in OpenAI's schema)."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class BodyLimitGuard:
    """Refuses (413) a request whose body is over ``max_bytes()`` bytes: at once when its
    Content-Length says so (the body is never read), else as soon as the chunks read so far
    pass the limit (a chunked body), long before the body is whole."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int]):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            refusal = error_response(413, str(BodyTooLarge(limit).detail))
            await refusal(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)  # rendered by the app's HTTP error handler
            return message

        await self.app(scope, receive_within_limit, send)


def install_guards(
    app: Starlette,
    max_body_bytes: Callable[[], int],
    api_key: str | None = None,
    open_paths: frozenset[str] = frozenset({"/health"}),
) -> None:
    """Put the body size limit and, with ``api_key``, the key check (outermost, so a request
    without the key is refused before anything of it is read) in front of every route."""
    app.add_middleware(BodyLimitGuard, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key, open_paths=open_paths)
