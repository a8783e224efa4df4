"""Turns the engine core's token updates into RequestOutputs: detokenization, stop strings,
logprob objects. Runs on the API side (the server process, or in-process for ``LLM``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tandem.request import TokenLogprobs
from tandem.sampling_params import SamplingParams
from tandem.step import RequestUpdate
from tandem.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """Everything the API side keeps about one request while it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # How much of text / token_ids / logprobs was already handed out (for deltas).
    sent_text: int = 0
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Keeps per-request API-side state and builds RequestOutputs from core updates."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            ),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark a request aborted on the API side; returns its final output."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = "abort"
        return self._output(state, delta=False)

    def process(
        self, updates: list[RequestUpdate], delta: bool = False, finished_only: bool = False
    ) -> tuple[list[RequestOutput], list[tuple[str, str]], list[tuple[str, str]]]:
        """Apply core updates. Returns the outputs (with ``finished_only``, those of the
        requests that finished: a caller that waits for whole results need not copy every
        running request's tokens each step), the (request id, stop string) pairs of
        requests that a stop string ended, which the core must finish, and the (request id,
        error) pairs of requests whose update raised here (detokenizing, a stop string):
        they end with finish reason "error", and the core must end them too."""
        outputs: list[RequestOutput] = []
        stopped: list[tuple[str, str]] = []
        failed: list[tuple[str, str]] = []
        for update in updates:
            state = self.states.get(update.request_id)
            if state is None:
                continue  # aborted on this side already
            try:
                output = self._apply_update(state, update, stopped, delta, finished_only)
            except Exception as error:  # noqa: BLE001 (a fault fails only its request)
                logger.error("request %s failed", state.request_id, exc_info=error)
                failed.append(
                    (state.request_id, f"internal error: {type(error).__name__}: {error}")
                )
                state.finish_reason, state.stop_reason = "error", None
                self.states.pop(state.request_id, None)
                output = self._output(state, delta)
            if output is not None:
                outputs.append(output)
        return outputs, stopped, failed

    def _apply_update(
        self,
        state: RequestState,
        update: RequestUpdate,
        stopped: list[tuple[str, str]],
        delta: bool,
        finished_only: bool,
    ) -> RequestOutput | None:
        """Apply one update to its request's state; the output to hand out, if any."""
        state.num_cached_tokens = update.num_cached_tokens
        if state.prompt_logprobs is not None:
            state.prompt_logprobs += [self._position(e) for e in update.new_prompt_logprobs]
        matched = self._append_tokens(state, update)
        if matched is not None:
            state.finish_reason, state.stop_reason = "stop", matched
            if update.finish_reason is None:
                stopped.append((state.request_id, matched))
        elif update.finish_reason is not None:
            state.finish_reason, state.stop_reason = update.finish_reason, update.stop_reason
            state.text += state.stop_matcher.flush()
        if state.finished:
            del self.states[state.request_id]
        elif finished_only:
            return None
        return self._output(state, delta)

    def _append_tokens(self, state: RequestState, update: RequestUpdate) -> str | None:
        """Add new tokens one by one; stop at the first stop string (returned)."""
        params = state.params
        for index, token_id in enumerate(update.new_token_ids):
            state.token_ids.append(token_id)
            if state.logprobs is not None and index < len(update.new_logprobs):
                entry = update.new_logprobs[index]
                state.logprobs.append(self._position(entry))
                state.cumulative_logprob += entry[1]
            if not params.detokenize:
                continue
            delta_text = state.detokenizer.append([token_id])
            if len(state.token_ids) <= params.min_tokens or not params.stop:
                state.text += delta_text
                continue
            safe_text, matched = state.stop_matcher.feed(delta_text)
            state.text += safe_text
            if matched is not None:
                return matched
        return None

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode_token(token_id)
        return text

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        token_id, logprob, rank, top = entry
        position = {
            top_id: Logprob(top_logprob, top_rank, self._decoded(top_id))
            for top_rank, (top_id, top_logprob) in enumerate(top, start=1)
        }
        if token_id not in position:
            position[token_id] = Logprob(logprob, rank, self._decoded(token_id))
        return position

    def _output(self, state: RequestState, delta: bool) -> RequestOutput:
        text, token_ids = state.text, state.token_ids
        logprobs = state.logprobs
        if delta:
            text = text[state.sent_text :]
            token_ids = token_ids[state.sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[state.sent_tokens :]
            state.sent_text, state.sent_tokens = len(state.text), len(state.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )
