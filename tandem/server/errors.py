"""Every 4xx/5xx the server returns, in OpenAI's error schema, with ``param`` naming the field
and no internal path or traceback in the message."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server.protocol import error_body

logger = logging.getLogger(__name__)

# The OpenAI error type of each status an HTTP exception of FastAPI or Starlette may carry.
_KIND_OF_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
# An absolute path of a file (with its line, as in a traceback): never shown to a client.
# (Not part of a URL: no ':', '/' or word character before it.)
_SOURCE_PATH = re.compile(r"""(?<![\w:/])"?(?:/[\w.\-]+){2,}"?(?:, line \d+)?""")
MAX_MESSAGE_CHARS = 1000


class ApiError(Exception):
    """An error with an HTTP status, rendered in the OpenAI error schema."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def check_model(model: str | None, served_model_name: str) -> None:
    """ApiError 404 naming ``model`` unless it is absent or the served model (every route
    that takes a ``model`` field answers a wrong one the same way)."""
    if model is not None and model != served_model_name:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {served_model_name!r}",
            "not_found_error",
            "model",
        )


def public_message(message: str) -> str:
    """``message`` without source paths, cut to a readable length."""
    message = _SOURCE_PATH.sub("<path>", message)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An OpenAI error body as JSON. ASCII-escaped, so text echoed from a request (even a
    lone surrogate) can always be encoded."""
    body = error_body(public_message(message), kind, status, param)
    return Response(
        json.dumps(body, ensure_ascii=True), status, headers, media_type="application/json"
    )


def _param_of(location: tuple) -> str | None:
    """The field a pydantic error location names: ``("body", "messages", 0, "role")`` is
    ``messages[0].role``; union member tags (``str``, ``list[int]``...) are left out."""
    name = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and not _is_type_tag(part):
            name += f".{part}" if name else part
    return name or None


def _top_field(param: str | None) -> str | None:
    """``messages`` for ``messages[0].content``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0] if param else None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error_response(exc: RequestValidationError) -> Response:
    """A 400 for a body that is not JSON or does not fit the request model; ``param`` names
    the field (for a value that fits no member of a union, the deepest field pydantic
    reached, with what each member wanted)."""
    errors = exc.errors()
    if not errors:
        return error_response(400, "request body: invalid request")
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        loc = first.get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return error_response(400, f"request body is not valid JSON: {why}{where}")
    located = [(_param_of(tuple(e.get("loc", ()))), e) for e in errors]
    top = _top_field(located[0][0])
    same_field = [(p, e) for p, e in located if top and _top_field(p) == top]
    param, first = max(same_field or located[:1], key=lambda pe: len(pe[1].get("loc", ())))
    if first.get("type") == "missing" and param:
        return error_response(400, f"{param} is required", param=param)
    if first.get("type") == "extra_forbidden" and param:
        return error_response(400, f"{param}: unknown parameter", param=param)
    why = "; or ".join(dict.fromkeys(e.get("msg", "invalid") for p, e in located if p == param))
    message = f"{param}: {why}" if param else f"request body: {why}"
    return error_response(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Render ApiError, FastAPI's validation and HTTP errors (404, 405...) and any uncaught
    exception (a 500 that says nothing of the code) in the OpenAI error schema."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = _KIND_OF_STATUS.get(exc.status_code, "invalid_request_error")
        if exc.status_code >= 500:
            kind = "server_error"
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            # FastAPI's "There was an error parsing the body", when the bytes were the fault.
            message = f"request body is not valid UTF-8: byte {cause.start} ({cause.reason})"
            return error_response(400, message, kind)
        return error_response(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "server_error")
