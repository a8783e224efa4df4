"""Completions and chat completions: run a prepared request through the engine client and
shape OpenAI responses, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from tandem.outputs import PositionLogprobs, RequestOutput
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.logprobs_format import (
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from tandem.server.metrics import ServerMetrics
from tandem.server.request_prep import PreparedRequest
from tandem.server.tool_parsers import ToolCallStream, tool_finish_reason, whole_reply

logger = logging.getLogger(__name__)


def make_runs(
    prepared: list[PreparedRequest], client, metrics: ServerMetrics, model_name: str
) -> list[RequestRun]:
    """The runs of one request's prepared parts, each sample linked to its prompt's first."""
    runs = [RequestRun(one, client, metrics, model_name) for one in prepared]
    for run in runs:
        if run.prepared.waits_for is not None:
            run.after = runs[run.prepared.waits_for]
    return runs


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
        # Chat with tools: the streamed reply split into content and tool calls.
        self.tool_stream = ToolCallStream(prepared.tools) if prepared.tools else None

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
        self, text, tokens, logprobs, finish_reason, chunk: bool, first=False, tool_calls=None
    ) -> dict:
        """One choice in the endpoint's shape (``logprobs`` already shaped; ``tool_calls``:
        the message's calls, or a chunk's call deltas)."""
        index = self.prepared.index
        if self.prepared.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs}
        elif chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            elif finish_reason is not None and not text:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            message = {"role": "assistant", "content": text}
            if tool_calls is not None:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        if self.prepared.return_token_ids:
            choice["token_ids"] = list(tokens)
        return choice

    def _split_tool_calls(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """A streamed delta's content and tool-call deltas (the held-back rest at the end)."""
        content, calls = self.tool_stream.feed(text)
        if finished:
            more, more_calls = self.tool_stream.finish()
            content, calls = content + more, calls + more_calls
        return content, calls

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
        content, calls, finish = prefix + "".join(text), None, self._finish(self.finish_reason)
        if self.prepared.tools is not None:
            content, calls = whole_reply(self.prepared.tools, content)
            finish = tool_finish_reason(self.prepared.tools, len(calls), finish)
        choice = self._choice(
            content,
            tokens,
            joined(prefix_logprobs, shaped) if self.prepared.echo is not None else shaped,
            finish,
            chunk=False,
            tool_calls=calls,
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
            calls = None
            if self.tool_stream is not None:
                text, calls = self._split_tool_calls(text, output.finished)
                finish = tool_finish_reason(self.prepared.tools, self.tool_stream.num_calls, finish)
                if not (text or calls or finish or shaped or self.prepared.return_token_ids):
                    continue  # held back: the text may open a tool call
            choice = self._choice(
                prefix + text, tokens, shaped, finish, chunk=True, first=first, tool_calls=calls
            )
            offset += len(prefix) + len(text)
            first = False
            if self.prepared.kind == "completion":
                choice.update(extra)
                extra = {}
            yield {**self.envelope([choice], chunk=True), **extra}
