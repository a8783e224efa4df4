"""A request's response from its runs (one per prompt): whole, or as server-sent events,
with the OpenAI error event that ends a stream which failed after its 200."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from tandem.sampling_params import ParamError
from tandem.server.engine_client import EngineDeadError, RequestFailed
from tandem.server.errors import public_message
from tandem.server.openai_serving import RequestRun
from tandem.server.protocol import error_body

logger = logging.getLogger(__name__)


async def stream_events(runs: list[RequestRun]) -> AsyncIterator[str]:
    """Server-sent events of several runs of one request (its prompts), as their chunks
    come; the usage (summed) if asked, then [DONE]. A failure of any run ends the stream
    with an error event (the other runs are cancelled, which aborts them)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: RequestRun) -> None:
        try:
            async for chunk in run.chunks():
                await queue.put(chunk)
        except Exception as e:  # noqa: BLE001 (a client disconnect is not an Exception)
            await queue.put(e)
        await queue.put(done)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                # The stream has begun (status 200 sent): the error is its last event.
                yield _sse(stream_error(item))
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse(item)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if runs[0].prepared.include_usage:
        yield _sse({**runs[0].envelope([], chunk=True), "usage": summed_usage(runs)})
    yield "data: [DONE]\n\n"


def summed_usage(runs: list[RequestRun]) -> dict:
    """The usage of several runs of one request: each prompt's tokens once, however many
    samples (``n``, ``best_of``) were drawn from it, as OpenAI and vLLM count them; every
    sample's completion tokens."""
    usages = [run.usage() for run in runs]
    prompt = sum(
        u["prompt_tokens"]
        for run, u in zip(runs, usages, strict=True)
        if run.prepared.index % run.prepared.samples == 0
    )
    completion = sum(u["completion_tokens"] for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def full_response(runs: list[RequestRun]) -> dict:
    """The whole response of one or more runs of one request (its prompts: a choice each)."""
    if len(runs) == 1:
        return await runs[0].full_response()
    parts = await asyncio.gather(*(run.response_parts() for run in runs))
    choices = sorted((choice for choice, _ in parts), key=lambda c: c["index"])
    keep = runs[0].prepared.keep_best
    if keep is not None:
        choices = best_choices(runs, [choice for choice, _ in parts], keep)
    return {**runs[0].envelope(choices, chunk=False), "usage": summed_usage(runs)}


def best_choices(runs: list[RequestRun], choices: list[dict], keep: int) -> list[dict]:
    """``best_of``: of each prompt's samples (consecutive runs), the ``keep`` with the
    highest cumulative logprob, best first, renumbered ``prompt * keep + rank``."""
    per_prompt = runs[0].prepared.samples
    best = []
    for start in range(0, len(runs), per_prompt):
        end = start + per_prompt
        group = list(zip(runs[start:end], choices[start:end], strict=True))
        group.sort(key=lambda pair: -(pair[0].cumulative_logprob or 0.0))
        for rank, (_, choice) in enumerate(group[:keep]):
            best.append({**choice, "index": start // per_prompt * keep + rank})
    return best


def stream_error(exc: Exception) -> dict:
    """The error event that ends a stream which failed after its 200, in OpenAI's error
    schema, with the status the same failure gets without streaming."""
    if isinstance(exc, ParamError):
        return error_body(public_message(str(exc)), "invalid_request_error", 400, exc.param)
    if isinstance(exc, ValueError):  # the core refused the request (RequestRejected)
        return error_body(public_message(str(exc)), "invalid_request_error", 400)
    if isinstance(exc, EngineDeadError):
        return error_body(public_message(str(exc)), "service_unavailable", 503)
    if isinstance(exc, RequestFailed):
        return error_body(public_message(str(exc)), "server_error", 502)
    logger.exception("stream failed")
    return error_body("internal server error", "server_error", 500)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
