"""The OpenAI-compatible HTTP server (FastAPI). The engine core runs in its own process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from tandem import __version__
from tandem.disagg.trust import PREFILL_SIGNATURE_HEADER, prefill_url_signed
from tandem.sampling_params import ParamError, check_text
from tandem.server.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestFailed,
    RequestTimedOut,
)
from tandem.server.errors import ApiError, check_model, install_error_handlers
from tandem.server.guards import default_max_body_bytes, install_guards
from tandem.server.metrics import ServerMetrics
from tandem.server.openai_serving import RequestRun, make_runs
from tandem.server.protocol import (
    PREFILL_URL_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
)
from tandem.server.request_prep import prepare_chat, prepare_completion
from tandem.server.response_streams import full_response, stream_events
from tandem.server.tokenize_routes import install_tokenize_routes

DISCONNECT_POLL_S = 0.2
# PD: how long asking a prefill instance for its control address may take, and how long
# an answer is used before it is asked again.
PREFILL_INFO_TIMEOUT_S = 5.0
PREFILL_INFO_TTL_S = 2.0


async def _respond(runs: list[RequestRun], request: Request) -> Response:
    """Stream the runs (a request's prompts), or wait for their whole response (aborting
    them if the client leaves)."""
    if runs[0].prepared.stream:
        return StreamingResponse(stream_events(runs), media_type="text/event-stream")
    task = asyncio.create_task(full_response(runs))
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except ParamError as e:
        raise ApiError(400, str(e), param=e.param) from e
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    except EngineDeadError as e:
        raise ApiError(503, str(e), "service_unavailable") from e
    except RequestTimedOut as e:
        raise ApiError(504, str(e), "timeout_error") from e
    except RequestFailed as e:
        raise ApiError(502, str(e), "server_error") from e


class PrefillAddresses:
    """PD, decode instances: the control address of each prefill instance named by URL,
    asked from its ``/v1/disagg/info`` (with this server's API key, which prefill and decode
    instances share).

    Only the router may name a prefill instance: a URL counts only with the router's
    signature of it (``tandem.disagg.trust``), so a client cannot make this server call an
    address of its choosing. An address is asked again once it is ``ttl_s`` old, or after a
    request to it failed, so a restarted or moved prefill instance is used again (a restart
    takes longer than ``ttl_s``, so the first request after it already asks afresh)."""

    def __init__(
        self,
        client: AsyncEngineClient,
        secret: str | None,
        api_key: str | None = None,
        ttl_s: float = PREFILL_INFO_TTL_S,
    ):
        self.client = client
        self.secret = secret
        self.api_key = api_key
        self.ttl_s = ttl_s
        # url -> (when asked, the answer): one question in flight per URL, shared.
        self._addresses: dict[str, tuple[float, asyncio.Future]] = {}

    def named_url(self, request: Request) -> str | None:
        """The prefill URL that ``request`` names, if any; ApiError 403 unless the router
        signed it."""
        url = request.headers.get(PREFILL_URL_HEADER)
        if url and not prefill_url_signed(
            self.secret, url, request.headers.get(PREFILL_SIGNATURE_HEADER)
        ):
            raise ApiError(
                403,
                f"{PREFILL_URL_HEADER} is honoured only from the router: it needs a valid "
                f"{PREFILL_SIGNATURE_HEADER} (the deployment's shared secret)",
                "permission_error",
                PREFILL_URL_HEADER,
            )
        return url or None

    async def watch(self, url: str | None, response: Awaitable[Response]) -> Response:
        """``response``; a 502 of a request through ``url`` makes its address asked afresh."""
        try:
            return await response
        except ApiError as e:
            if url and e.status == 502:
                self.forget(url)
            raise

    async def resolve(self, url: str) -> str:
        """The control address of the prefill instance at ``url`` (ApiError if none)."""
        role = self.client.info.role
        if role != "decode":
            raise ApiError(
                400,
                f"{PREFILL_URL_HEADER} given, but this instance's role is {role!r}, not 'decode'",
            )
        now = time.monotonic()
        entry = self._addresses.get(url)
        failed = entry is not None and entry[1].done() and entry[1].exception() is not None
        if entry is None or failed or now - entry[0] > self.ttl_s:
            entry = (now, asyncio.ensure_future(self._ask(url)))
            self._addresses[url] = entry
        return await asyncio.shield(entry[1])

    def forget(self, url: str) -> None:
        """A request through ``url`` failed: ask its address afresh next time."""
        self._addresses.pop(url, None)

    async def _ask(self, url: str) -> str:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=PREFILL_INFO_TIMEOUT_S) as http:
                reply = await http.get(url.rstrip("/") + "/v1/disagg/info", headers=headers)
                reply.raise_for_status()
                info = reply.json()
        except (httpx.HTTPError, ValueError) as e:
            raise ApiError(
                502, f"prefill instance {url} did not answer: {e}", "server_error"
            ) from e
        if not isinstance(info, dict) or info.get("role") != "prefill":
            role = info.get("role") if isinstance(info, dict) else None
            raise ApiError(502, f"{url} is not a prefill instance (role {role!r})", "server_error")
        address = info.get("control_address")
        if not (isinstance(address, str) and address.startswith("tcp://")):
            raise ApiError(502, f"{url} gave no control address", "server_error")
        return address


def _check_admission(
    client: AsyncEngineClient, model: str | None, served_model_name: str, max_pending: int
) -> None:
    """Refuse a request for another model, or while the engine is dead or full."""
    check_model(model, served_model_name)
    if client.dead:
        raise ApiError(503, f"engine is not running: {client.dead}", "service_unavailable")
    if client.num_active_requests >= max_pending:
        raise ApiError(503, "server is over its request limit; retry later", "service_unavailable")


def _check_room(client: AsyncEngineClient, num_runs: int, max_pending: int) -> None:
    """Refuse a request whose prompts and samples would take the engine over its request
    limit: a 400 if they never fit, else a 503 (retry later)."""
    if num_runs > max_pending:
        raise ApiError(
            400,
            f"the request asks for {num_runs} sequences (prompts x n or best_of), over this "
            f"server's limit of {max_pending}",
            param="n",
        )
    if client.num_active_requests + num_runs > max_pending:
        raise ApiError(503, "server is over its request limit; retry later", "service_unavailable")


def _body_limit(client: AsyncEngineClient, fixed: int | None):
    """The body size limit as a function: ``fixed``, or the default for the engine's
    max_model_len (known once it has started)."""
    if fixed is not None and fixed < 1:
        raise ValueError(f"max_request_body_bytes must be positive, got {fixed}")
    if fixed is not None:
        return lambda: fixed
    return lambda: default_max_body_bytes(client.info.max_model_len if client.info else 0)


def _check_strings(body: CompletionRequest | ChatCompletionRequest) -> None:
    """ParamError for a lone surrogate in a string field no later check reads."""
    for name in ("model", "user"):
        if getattr(body, name) is not None:
            check_text(name, getattr(body, name))


def build_app(
    client: AsyncEngineClient,
    served_model_name: str,
    api_key: str | None = None,
    max_pending_requests: int = 1024,
    *,
    metrics_without_key: bool = False,
    max_request_body_bytes: int | None = None,
    disagg_secret: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """An app serving ``client``; the caller starts and stops the client (see ``lifespan``).

    With ``api_key``, every route but ``/health`` (and ``/metrics`` with
    ``metrics_without_key``) needs it, the docs and ``/v1/disagg/info`` included. A body
    over ``max_request_body_bytes`` (default: ``default_max_body_bytes`` of the engine's
    max_model_len) is refused with a 413 before it is read. ``disagg_secret`` (decode
    instances): the router's signature of a prefill URL is checked with it.
    ``tool_call_parser``: allows ``tool_choice: "auto"``, tool calls read in that format."""

    body_limit = _body_limit(client, max_request_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if client.info is None:
            await client.start()
        yield
        await client.shutdown()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    metrics = ServerMetrics(served_model_name)
    app.state.client, app.state.metrics = client, metrics
    install_error_handlers(app)
    open_paths = frozenset({"/health", "/ping"} | ({"/metrics"} if metrics_without_key else set()))
    install_guards(app, body_limit, api_key, open_paths)
    prefill_addresses = PrefillAddresses(client, disagg_secret, api_key)
    prepare_tool_chat = functools.partial(prepare_chat, tool_parser=tool_call_parser)

    async def run(prepare, body, request: Request):
        prefill_url = prefill_addresses.named_url(request)
        try:
            _check_strings(body)
            _check_admission(client, body.model, served_model_name, max_pending_requests)
            # Tokenizing and templating a long prompt takes a while: not on the event loop.
            prepared = await asyncio.to_thread(prepare, body, client)
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from e
        except ValueError as e:  # the tokenizer's (a chat template's) own
            raise ApiError(400, str(e)) from e
        _check_room(client, len(prepared), max_pending_requests)
        remote = await prefill_addresses.resolve(prefill_url) if prefill_url else None
        for one in prepared:
            one.remote_prefill = remote
        runs = make_runs(prepared, client, metrics, served_model_name)
        return await prefill_addresses.watch(prefill_url, _respond(runs, request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(prepare_completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(prepare_tool_chat, body, request)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "max_model_len": client.info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    install_tokenize_routes(app, client, served_model_name)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) liveness check, GET and POST
    @app.post("/ping")
    async def health():
        if client.dead:
            return JSONResponse({"status": "error", "reason": client.dead}, 503)
        return {"status": "ok"}

    @app.get("/v1/disagg/info")
    async def disagg_info():
        info = client.info
        return {
            "role": info.role,
            "control_address": info.control_address,
            "num_kv_blocks": info.num_kv_blocks,
            "block_size": info.block_size,
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        rendered = metrics.render(client.stats, engine_live=client.dead is None)
        return Response(rendered, media_type="text/plain; version=0.0.4")

    _add_head_routes(app)
    return app


def _add_head_routes(app: FastAPI) -> None:
    """``HEAD`` beside each GET route of ``app`` (FastAPI adds none; the docs' routes have
    it already): the GET handler answers, and the server sends its status and headers
    without the body. Left out of the OpenAPI schema."""
    for route in list(app.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods:
            app.add_api_route(
                route.path,
                route.endpoint,
                methods=["HEAD"],
                response_class=route.response_class,
                include_in_schema=False,
                name=f"{route.name}_head",
            )
