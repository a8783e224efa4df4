"""Completions and chat completions: run a request through the engine client and shape
OpenAI responses, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from copy import copy
from dataclasses import dataclass, field, replace

from tandem.outputs import PositionLogprobs, RequestOutput
from tandem.sampling_params import ParamError, SamplingParams
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.logprobs_format import (
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest

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
    # The engine's request id; the response's id ("cmpl-..." / "chatcmpl-...") is the same
    # unless the request has several prompts (then each runs as "<response id>-<index>").
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's index
    response_id: str = ""
    # Completions: the prompt's text before the completion (``echo``); with
    # ``discard_output`` (``max_tokens: 0``) nothing generated is returned.
    echo: str | None = None
    discard_output: bool = False
    # vLLM's ``prompt_logprobs`` field: the top entries per prompt token (None: not asked).
    prompt_logprobs: int | None = None
    # ``n`` > 1: the run (of this request) whose prefill this sample waits for.
    waits_for: int | None = None
    # ``best_of`` > n: the samples per prompt are ranked and this many kept; the engine
    # computes logprobs for the ranking that the response leaves out (``hide_logprobs``).
    keep_best: int | None = None
    hide_logprobs: bool = False
    samples: int = 1  # the samples drawn per prompt (``n``, or ``best_of``)


def prepare_completion(body: CompletionRequest, client: AsyncEngineClient) -> list[PreparedRequest]:
    """A validated completion request: one prepared run per prompt (ParamError names a bad
    field)."""
    body.check_supported()
    prompts = body.prompts()
    max_tokens = body.checked_max_tokens()
    logprobs = body.checked_logprobs()
    # The engine's prompt logprobs: what echo with logprobs and prompt_logprobs ask for.
    wanted = [body.prompt_logprobs]
    if body.echo and logprobs is not None:
        wanted.append(logprobs)
    wanted = [n for n in wanted if n is not None]
    best_of = body.checked_best_of()
    ranked = best_of > body.n
    # Ranking samples needs their cumulative logprobs: asked of the engine, not returned.
    engine_logprobs = 0 if ranked and logprobs is None else logprobs
    params = body.to_sampling_params(
        max(max_tokens, 1), engine_logprobs, prompt_logprobs=max(wanted) if wanted else None
    )
    runs = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, token_ids = prompt, client.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        try:
            prepared = _prepared("completion", text, token_ids, copy(params), body, client)
        except ParamError as e:
            if len(prompts) == 1 or e.param != "prompt":
                raise
            raise ParamError(f"prompt[{index}]", f"prompt[{index}]: {e}") from None
        if body.echo:
            prepared.echo = text if text is not None else client.tokenizer.decode(token_ids, False)
        prepared.discard_output = max_tokens == 0
        prepared.prompt_logprobs = body.prompt_logprobs
        prepared.hide_logprobs = logprobs is None
        prepared.keep_best = body.n if ranked else None
        runs.append(prepared)
    return _fan_out(runs, best_of)


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` (of ``n``) of a request seeded with ``seed``: the
    request's own for the first, a hash of both for the others; None stays None (each
    sample then gets its own seed from the engine)."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _fan_out(prepared: list[PreparedRequest], n: int) -> list[PreparedRequest]:
    """``n`` samples of each prompt's run: choice ``prompt * n + sample``, each an engine
    request ``<response id>-<choice>`` when there are several. A sample after its prompt's
    first waits for the first's prefill (``waits_for``), so that it finds the prompt's blocks
    in the prefix cache: the prompt is prefilled once."""
    runs: list[PreparedRequest] = []
    for prompt_index, first in enumerate(prepared):
        first_run = len(runs)
        for sample in range(n):
            one = first
            if sample:
                params = replace(first.params, seed=sample_seed(first.params.seed, sample))
                one = replace(first, params=params, waits_for=first_run)
            one.index, one.samples = prompt_index * n + sample, n
            runs.append(one)
    if len(runs) > 1:
        response_id = runs[0].response_id
        for one in runs:
            one.request_id, one.response_id = f"{response_id}-{one.index}", response_id
    return runs


def make_runs(
    prepared: list[PreparedRequest], client, metrics: ServerMetrics, model_name: str
) -> list[RequestRun]:
    """The runs of one request's prepared parts, each sample linked to its prompt's first."""
    runs = [RequestRun(one, client, metrics, model_name) for one in prepared]
    for run in runs:
        if run.prepared.waits_for is not None:
            run.after = runs[run.prepared.waits_for]
    return runs


def prepare_chat(body: ChatCompletionRequest, client: AsyncEngineClient) -> list[PreparedRequest]:
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
        prepared = _prepared("chat", None, token_ids, params, body, client)
        prepared.prompt_logprobs = body.prompt_logprobs
        return _fan_out([prepared], body.n)
    except ParamError as e:
        if e.param != "prompt":
            raise
        raise ParamError("messages", str(e)) from None


def _prepared(kind, text, token_ids, params, body, client) -> PreparedRequest:
    try:
        client.validate_prompt(token_ids, params)
    except ParamError as e:  # a constraint that does not compile: named as the body asks
        if e.param != "guided":
            raise
        raise ParamError(body.guided_constraint()[0], str(e)) from None
    if params.max_tokens is None:
        params.max_tokens = client.info.max_model_len - len(token_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    request_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    return PreparedRequest(
        kind,
        text,
        token_ids,
        params,
        body.stream,
        include_usage,
        body.return_token_ids,
        request_id=request_id,
        response_id=request_id,
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
        # ``n`` > 1: the run whose first output (its prefill done) this one waits for.
        self.after: RequestRun | None = None
        self.started = asyncio.Event()
        self.cumulative_logprob: float | None = None  # of the whole response (best_of)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            if self.after is not None:
                await self.after.started.wait()
            async for output in self._outputs():
                self.started.set()
                yield output
        finally:
            self.started.set()  # a failed or cancelled run holds no sibling back

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
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
        return self.prepared.response_id

    def usage(self) -> dict:
        prompt_tokens = len(self.prepared.prompt_token_ids)
        completion_tokens = 0 if self.prepared.discard_output else self.num_generated
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        """The response (or chunk) around ``choices``."""
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

    def _logprobs(self, tokens: list[int], logprobs: list[PositionLogprobs] | None, offset: int):
        num_top = self.prepared.params.logprobs
        if logprobs is None or num_top is None or self.prepared.hide_logprobs:
            return None
        if self.prepared.kind == "chat":
            return chat_logprobs(tokens, logprobs, num_top)
        return completion_logprobs(tokens, logprobs, num_top, offset)

    def _prompt_parts(self, output: RequestOutput) -> tuple[str, dict | None, dict]:
        """What goes before the first generated text: the echoed prompt and its logprobs
        (completions with ``echo``), and vLLM's ``prompt_logprobs`` field."""
        p = self.prepared
        text, logprobs, extra = "", None, {}
        positions = output.prompt_logprobs
        if p.echo is not None:
            text = p.echo
            if p.params.logprobs is not None and positions is not None:
                first = self.client.tokenizer.decode_token(p.prompt_token_ids[0])
                logprobs = echoed_prompt_logprobs(
                    p.prompt_token_ids, positions, p.params.logprobs, first
                )
        if p.prompt_logprobs is not None and positions is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                p.prompt_token_ids, positions, p.prompt_logprobs
            )
        return text, logprobs, extra

    def _finish(self, reason: str | None) -> str | None:
        """The finish reason to report: with ``max_tokens: 0`` (one token generated and
        dropped) the limit, whatever ended that token."""
        return "length" if reason is not None and self.prepared.discard_output else reason

    def _choice(
        self, text, tokens, logprobs, finish_reason, chunk: bool, first: bool = False
    ) -> dict:
        """One choice in the endpoint's shape (``logprobs`` already shaped)."""
        index = self.prepared.index
        if self.prepared.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs}
        elif chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": index, "message": message, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(tokens)
        return choice

    async def response_parts(self) -> tuple[dict, dict]:
        """The whole run: its choice and the envelope's extra fields (chat's
        ``prompt_logprobs``)."""
        text, tokens, logprobs = [], [], []
        last = None
        async for output in self.outputs():
            last = output
            completion = output.outputs[0]
            self.cumulative_logprob = completion.cumulative_logprob
            text.append(completion.text)
            tokens += completion.token_ids
            if completion.logprobs is not None:
                logprobs += completion.logprobs
        prefix, prefix_logprobs, extra = self._prompt_parts(last) if last else ("", None, {})
        if self.prepared.discard_output:
            text, tokens, logprobs = [], [], []
        shaped = self._logprobs(tokens, logprobs, len(prefix))
        choice = self._choice(
            prefix + "".join(text),
            tokens,
            joined(prefix_logprobs, shaped) if self.prepared.echo is not None else shaped,
            self._finish(self.finish_reason),
            chunk=False,
        )
        if self.prepared.kind == "completion":
            choice.update(extra)
            extra = {}
        return choice, extra

    async def full_response(self) -> dict:
        choice, extra = await self.response_parts()
        return {**self.envelope([choice], chunk=False), **extra, "usage": self.usage()}

    async def chunks(self) -> AsyncIterator[dict]:
        """The streamed chunks (without usage and [DONE]); a failure raises."""
        first, offset = True, 0
        if self.prepared.kind == "chat":
            yield self.envelope([self._choice("", [], None, None, chunk=True, first=True)], True)
            first = False
        started = False
        async for output in self.outputs():
            completion = output.outputs[0]
            text, tokens, logprobs = completion.text, completion.token_ids, completion.logprobs
            if self.prepared.discard_output:
                text, tokens, logprobs = "", [], None
            extra: dict = {}
            prefix, prefix_logprobs = "", None
            if not started:
                # The prompt's part goes with the first output after its prefill (its
                # logprobs complete), with the first generated text.
                if not (tokens or text or output.finished):
                    continue
                prefix, prefix_logprobs, extra = self._prompt_parts(output)
            elif not (text or tokens or output.finished):
                continue
            started = True
            shaped = joined(prefix_logprobs, self._logprobs(tokens, logprobs, offset + len(prefix)))
            finish = self._finish(completion.finish_reason)
            choice = self._choice(prefix + text, tokens, shaped, finish, chunk=True, first=first)
            offset += len(prefix) + len(text)
            first = False
            if self.prepared.kind == "completion":
                choice.update(extra)
                extra = {}
            yield {**self.envelope([choice], chunk=True), **extra}
