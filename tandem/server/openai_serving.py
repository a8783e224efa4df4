"""Completions and chat completions: run a request through the engine client and shape
OpenAI responses, whole or as server-sent events."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.outputs import PositionLogprobs, RequestOutput
from tandem.sampling_params import ParamError, SamplingParams
from tandem.server.engine_client import AsyncEngineClient, EngineDeadError, RequestFailed
from tandem.server.errors import public_message
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated request ready for the engine."""

    kind: str  # "completion" or "chat"
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    # PD: the control address of the prefill instance that computes the prompt's KV.
    remote_prefill: str | None = None
    # The response's id ("cmpl-..." / "chatcmpl-...") is the engine's request id too.
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def prepare_completion(body: CompletionRequest, client: AsyncEngineClient) -> PreparedRequest:
    """A validated completion request (ParamError names a bad field)."""
    body.check_supported()
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        text, token_ids = prompt, client.tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
    params = body.to_sampling_params(body.max_tokens, body.checked_logprobs())
    return _prepared("completion", text, token_ids, params, body, client)


def prepare_chat(body: ChatCompletionRequest, client: AsyncEngineClient) -> PreparedRequest:
    """A validated chat request (ParamError names a bad field; a prompt problem names
    ``messages``)."""
    body.check_supported()
    if not body.messages:
        raise ParamError("messages", "messages must not be empty")
    messages = [m.template_fields(f"messages[{i}]") for i, m in enumerate(body.messages)]
    max_tokens, max_tokens_field = body.checked_max_tokens()
    renamed = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"}
    params = body.to_sampling_params(max_tokens, body.checked_logprobs(), renamed)
    token_ids = client.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
    try:
        return _prepared("chat", None, token_ids, params, body, client)
    except ParamError as e:
        if e.param != "prompt":
            raise
        raise ParamError("messages", str(e)) from None


def _prepared(kind, text, token_ids, params, body, client) -> PreparedRequest:
    client.validate_prompt(token_ids, params)
    if params.max_tokens is None:
        params.max_tokens = client.info.max_model_len - len(token_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    return PreparedRequest(
        kind,
        text,
        token_ids,
        params,
        body.stream,
        include_usage,
        body.return_token_ids,
        request_id=prefix + uuid.uuid4().hex,
    )


class RequestRun:
    """Drives one request: yields delta outputs, records metrics, builds responses."""

    def __init__(
        self,
        prepared: PreparedRequest,
        client: AsyncEngineClient,
        metrics: ServerMetrics,
        model_name: str,
    ):
        self.prepared = prepared
        self.client = client
        self.metrics = metrics
        self.model_name = model_name
        self.num_generated = 0
        self.finish_reason: str | None = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        p = self.prepared
        start = time.monotonic()
        last = start
        async for output in self.client.generate(
            p.prompt, p.prompt_token_ids, p.params, p.remote_prefill, p.request_id
        ):
            now = time.monotonic()
            new_tokens = len(output.outputs[0].token_ids)
            if new_tokens:
                if self.num_generated == 0:
                    self.metrics.ttft.labels(self.model_name).observe(now - start)
                else:
                    self.metrics.itl.labels(self.model_name).observe((now - last) / new_tokens)
                last = now
            self.num_generated += new_tokens
            if output.finished:
                self.finish_reason = output.outputs[0].finish_reason
                self.metrics.e2e.labels(self.model_name).observe(now - start)
                self.metrics.record_finish(
                    self.finish_reason, len(p.prompt_token_ids), self.num_generated
                )
            yield output

    # ---- shapes --------------------------------------------------------------------------

    @property
    def response_id(self) -> str:
        return self.prepared.request_id

    def usage(self) -> dict:
        prompt_tokens = len(self.prepared.prompt_token_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.num_generated,
            "total_tokens": prompt_tokens + self.num_generated,
        }

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = self.prepared.kind
        if kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.prepared.created,
            "model": self.model_name,
            "choices": choices,
        }

    def _logprobs(
        self, tokens: list[int], logprobs: list[PositionLogprobs] | None, text_offset: int
    ) -> dict | None:
        if logprobs is None or self.prepared.params.logprobs is None:
            return None
        num_top = self.prepared.params.logprobs
        if self.prepared.kind == "chat":
            content = []
            for token, position in zip(tokens, logprobs, strict=True):
                chosen = position[token]
                top = sorted(position.items(), key=lambda kv: kv[1].rank)[:num_top]
                content.append(
                    {
                        "token": chosen.decoded_token,
                        "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()),
                        "top_logprobs": [
                            {
                                "token": lp.decoded_token,
                                "logprob": lp.logprob,
                                "bytes": list(lp.decoded_token.encode()),
                            }
                            for _, lp in top
                            if lp.rank <= num_top
                        ],
                    }
                )
            return {"content": content}
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = text_offset
        for token, position in zip(tokens, logprobs, strict=True):
            chosen = position[token]
            result["tokens"].append(chosen.decoded_token)
            result["token_logprobs"].append(chosen.logprob)
            result["top_logprobs"].append(
                {
                    lp.decoded_token: lp.logprob
                    for _, lp in sorted(position.items(), key=lambda kv: kv[1].rank)
                    if lp.rank <= num_top
                }
                if num_top
                else None
            )
            result["text_offset"].append(offset)
            offset += len(chosen.decoded_token)
        return result

    def _choice(
        self,
        text: str,
        tokens: list[int],
        logprobs,
        finish_reason,
        chunk: bool,
        text_offset: int = 0,
        first: bool = False,
    ) -> dict:
        choice = self._shaped_choice(
            text, tokens, logprobs, finish_reason, chunk, text_offset, first
        )
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(tokens)
        return choice

    def _shaped_choice(
        self, text, tokens, logprobs, finish_reason, chunk, text_offset, first
    ) -> dict:
        lp = self._logprobs(tokens, logprobs, text_offset)
        if self.prepared.kind == "completion":
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason}

    async def full_response(self) -> dict:
        text, tokens, logprobs = [], [], []
        async for output in self.outputs():
            completion = output.outputs[0]
            text.append(completion.text)
            tokens += completion.token_ids
            if completion.logprobs is not None:
                logprobs += completion.logprobs
        has_logprobs = self.prepared.params.logprobs is not None
        choice = self._choice(
            "".join(text),
            tokens,
            logprobs if has_logprobs else None,
            self.finish_reason,
            chunk=False,
        )
        return {**self._envelope([choice], chunk=False), "usage": self.usage()}

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine output, usage if asked, then [DONE]."""
        first, offset = True, 0
        if self.prepared.kind == "chat":
            yield _sse(
                self._envelope(
                    [self._choice("", [], None, None, chunk=True, first=True)], chunk=True
                )
            )
            first = False
        try:
            async for output in self.outputs():
                completion = output.outputs[0]
                if not completion.text and not completion.token_ids and not output.finished:
                    continue
                choice = self._choice(
                    completion.text,
                    completion.token_ids,
                    completion.logprobs,
                    completion.finish_reason,
                    chunk=True,
                    text_offset=offset,
                    first=first,
                )
                offset += len(completion.text)
                first = False
                yield _sse(self._envelope([choice], chunk=True))
        except Exception as e:  # noqa: BLE001 (a client disconnect is not an Exception)
            # The stream has begun (status 200 sent): the error is its last event.
            yield _sse(stream_error(e))
            yield "data: [DONE]\n\n"
            return
        if self.prepared.include_usage:
            yield _sse({**self._envelope([], chunk=True), "usage": self.usage()})
        yield "data: [DONE]\n\n"


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
