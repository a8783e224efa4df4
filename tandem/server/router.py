"""The OpenAI-API router in front of prefill and decode instances (PD disaggregation).

For each request the router picks one healthy prefill and one healthy decode instance
(round-robin per role) and forwards the client's body unchanged to the decode instance,
naming the prefill in a header the router signs (``tandem.disagg.trust``): the decode
instance asks it to run the prompt and hand over the KV cache. Responses are relayed as they
arrive; errors (the router's own and FastAPI's) are in OpenAI's schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.disagg.trust import PREFILL_SIGNATURE_HEADER, sign_prefill_url
from tandem.server.errors import ApiError, install_error_handlers
from tandem.server.guards import install_guards
from tandem.server.protocol import PREFILL_URL_HEADER, error_body

ROLES = ("prefill", "decode")
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0
DISCONNECT_POLL_S = 0.2
# Failures that prove the request never reached the instance, so a retry cannot run it twice.
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
READ_ERRORS = (httpx.HTTPError, httpx.StreamError)
DONE_EVENT = b"data: [DONE]"
# The router reads a whole body before it forwards it: it refuses one past this.
DEFAULT_MAX_BODY_BYTES = 64 << 20

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Instance:
    """One prefill or decode server and what the router last learned of its health."""

    url: str
    role: str
    healthy: bool = True


class RouterState:
    """The instances, their health, the round-robin cursors and the shared HTTP client."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        health_interval_s: float,
        request_timeout_s: float,
        transport: httpx.AsyncBaseTransport | None,
    ):
        for field, value in (
            ("health_interval_s", health_interval_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{field} must be positive, got {value}")
        self.instances: dict[str, list[Instance]] = {}
        for role, urls in zip(ROLES, (prefill_urls, decode_urls), strict=True):
            if not urls:
                raise ValueError(f"{role}_urls: at least one {role} instance URL is required")
            bad = [url for url in urls if not url.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"{role}_urls: {bad[0]!r} is not an http:// or https:// URL")
            self.instances[role] = [Instance(url.rstrip("/"), role) for url in urls]
        self.health_interval_s = health_interval_s
        self._timeout = httpx.Timeout(
            request_timeout_s, connect=min(CONNECT_TIMEOUT_S, request_timeout_s)
        )
        self._transport = transport
        self._cursor = dict.fromkeys(ROLES, 0)
        self._health_task: asyncio.Task | None = None
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        """Open the HTTP client, check every instance once, then keep checking in the background."""
        # No connection limit: every streaming request holds one connection for its whole life.
        self.client = httpx.AsyncClient(
            transport=self._transport,
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=None),
        )
        await self.check_health_once()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        """Stop the health checks and close the HTTP client."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    def describe(self) -> list[dict]:
        """Every instance as ``{"url", "role", "healthy"}``."""
        return [
            {"url": inst.url, "role": inst.role, "healthy": inst.healthy}
            for role in ROLES
            for inst in self.instances[role]
        ]

    def has_healthy(self, role: str) -> bool:
        """Whether at least one instance of ``role`` is healthy."""
        return any(inst.healthy for inst in self.instances[role])

    def pick(self, role: str, exclude: tuple[Instance, ...] = ()) -> Instance | None:
        """The next healthy instance of ``role`` in round-robin order, or None."""
        instances = self.instances[role]
        for step in range(len(instances)):
            index = (self._cursor[role] + step) % len(instances)
            inst = instances[index]
            if inst.healthy and all(inst is not other for other in exclude):
                self._cursor[role] = index + 1
                return inst
        return None

    def pick_or_503(self, role: str, exclude: tuple[Instance, ...] = ()) -> Instance:
        """Like ``pick``, but raises ``unavailable(role)`` when there is none."""
        inst = self.pick(role, exclude)
        if inst is None:
            raise self.unavailable(role)
        return inst

    def unavailable(self, role: str) -> ApiError:
        """A 503 saying that no instance of ``role`` is healthy."""
        urls = ", ".join(inst.url for inst in self.instances[role])
        return ApiError(503, f"no healthy {role} instance (of {urls})", "service_unavailable")

    def set_health(self, inst: Instance, healthy: bool, reason: str = "") -> None:
        """Record an instance's health, logging changes."""
        if inst.healthy != healthy:
            logger.warning(
                "%s instance %s is now %s%s",
                inst.role,
                inst.url,
                "healthy" if healthy else "unhealthy",
                f": {reason}" if reason else "",
            )
        inst.healthy = healthy

    async def check_health_once(self) -> None:
        """GET ``/health`` on every instance at once; anything but a 200 marks it unhealthy."""
        everyone = [inst for role in ROLES for inst in self.instances[role]]
        await asyncio.gather(*(self._check(inst) for inst in everyone))

    async def _check(self, inst: Instance) -> None:
        try:
            response = await self.client.get(f"{inst.url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.set_health(inst, False, f"health check failed: {exc!r}")
            return
        self.set_health(
            inst, response.status_code == 200, f"health check answered {response.status_code}"
        )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health_once()
            except Exception:  # the checker must outlive any surprise; the next round may pass
                logger.exception("health check round failed")

    async def send_to_decode(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[Instance, httpx.Response]:
        """Send to a healthy decode instance, retrying once on another if it cannot connect;
        the instance and its response (its body still unread)."""
        tried: tuple[Instance, ...] = ()
        for _ in range(2):  # the first choice, then one retry
            decode = self.pick_or_503("decode", exclude=tried)
            request = self.client.build_request(
                method, decode.url + path, content=content, headers=headers
            )
            try:
                return decode, await self.client.send(request, stream=True)
            except CONNECT_ERRORS as exc:
                self.set_health(decode, False, f"request failed to connect: {exc!r}")
                tried += (decode,)
            except httpx.HTTPError as exc:
                raise bad_gateway(decode, f"failed before answering: {exc!r}") from exc
        if not self.has_healthy("decode"):
            raise self.unavailable("decode")
        raise ApiError(
            502,
            f"decode instances {', '.join(inst.url for inst in tried)} could not be reached",
            "bad_gateway",
        )


def bad_gateway(decode: Instance, what: str) -> ApiError:
    """A 502 naming the decode instance at fault."""
    return ApiError(502, f"decode instance {decode.url} {what}", "bad_gateway")


def _complete_events_end(buffer: bytes) -> int:
    """The length of the prefix of ``buffer`` made of whole SSE events (0 if none)."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.rfind(sep)) >= 0]
    return max(ends, default=0)


async def relay_stream(decode: Instance, upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream SSE bytes, whole events as they arrive; an error event if the stream breaks."""
    pending, saw_done, failure = b"", False, ""
    try:
        async for chunk in upstream.aiter_bytes():
            pending += chunk
            cut = _complete_events_end(pending)
            if cut:
                events, pending = pending[:cut], pending[cut:]
                saw_done = events.rstrip().endswith(DONE_EVENT)
                yield events
        if not saw_done:
            failure = "closed the stream before data: [DONE]"
    except READ_ERRORS as exc:
        failure = f"failed mid-stream: {exc!r}"
    finally:
        await upstream.aclose()  # also aborts the decode request when our client went away
    if not failure:
        if pending:
            yield pending
        return
    logger.warning("decode instance %s %s", decode.url, failure)
    error = error_body(f"decode instance {decode.url} {failure}", "bad_gateway", 502)
    yield f"data: {json.dumps(error)}\n\n".encode() + DONE_EVENT + b"\n\n"


async def relay_body(decode: Instance, upstream: httpx.Response) -> Response:
    """The upstream status and whole body; the upstream response is closed after."""
    try:
        content = await upstream.aread()
    except READ_ERRORS as exc:
        raise bad_gateway(decode, f"failed while answering: {exc!r}") from exc
    finally:
        await upstream.aclose()
    media_type = upstream.headers.get("content-type", "application/json")
    return Response(content, upstream.status_code, media_type=media_type)


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response, or 499 once the client goes away.

    Cancelling ``work`` closes its upstream connection, so the decode instance aborts too.
    A decode answers a non-streaming request only when it is done, so waiting for the
    response headers must be watched as well as reading the body.
    """
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                return Response(status_code=499)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _prefill_headers(url: str, secret: str | None) -> dict[str, str]:
    """The headers naming the prefill instance, signed when a secret is set."""
    signed = {PREFILL_SIGNATURE_HEADER: sign_prefill_url(secret, url)} if secret else {}
    return {PREFILL_URL_HEADER: url, **signed}


def build_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    health_interval_s: float = 2.0,
    request_timeout_s: float = 600.0,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    transport: httpx.AsyncBaseTransport | None = None,
    disagg_secret: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """A router app over the given instances; its state is ``app.state.router`` (RouterState).

    A body over ``max_request_body_bytes`` is refused (413) before it is read; with ``api_key``
    every route but /health needs it. ``disagg_secret`` signs the prefill URL it names (decode
    instances refuse an unsigned one); ``transport`` replaces the network (tests pass one).
    """
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be positive, got {max_request_body_bytes}")
    state = RouterState(prefill_urls, decode_urls, health_interval_s, request_timeout_s, transport)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.router = state

    install_error_handlers(app)
    install_guards(app, lambda: max_request_body_bytes, api_key)

    def auth_headers(request: Request) -> dict[str, str]:
        authorization = request.headers.get("authorization")
        return {"authorization": authorization} if authorization else {}

    async def relay(
        method: str,
        path: str,
        headers: dict[str, str],
        content: bytes | None = None,
        stream: bool = False,
    ) -> Response:
        decode, upstream = await state.send_to_decode(
            method, path, content=content, headers=headers
        )
        # An error answer to a streaming request is relayed as plain JSON, not as a stream.
        if stream and upstream.status_code < 400:
            return StreamingResponse(
                relay_stream(decode, upstream), upstream.status_code, media_type="text/event-stream"
            )
        return await relay_body(decode, upstream)

    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ApiError(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            ) from exc
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
        prefill = state.pick_or_503("prefill")
        headers = {
            "content-type": "application/json",
            **_prefill_headers(prefill.url, disagg_secret),
            **auth_headers(request),
        }
        stream = body.get("stream") is True
        return await unless_disconnected(request, relay("POST", path, headers, raw, stream))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        return await unless_disconnected(request, relay("GET", "/v1/models", auth_headers(request)))

    @app.get("/health")
    async def health():
        missing = [role for role in ROLES if not state.has_healthy(role)]
        if missing:
            reason = " and ".join(f"no healthy {role} instance" for role in missing)
            return JSONResponse({"status": "error", "reason": reason}, 503)
        return {"status": "ok"}

    @app.get("/router/instances")
    async def instances():
        return state.describe()

    return app


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str,
    port: int,
    *,
    log_level: str = "info",
    **kw,
) -> None:
    """Serve the router with uvicorn until interrupted; ``kw`` goes to ``build_router_app``."""
    import uvicorn

    app = build_router_app(prefill_urls, decode_urls, **kw)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
