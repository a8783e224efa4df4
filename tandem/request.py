"""One request's state inside the engine core. Plain Python: no torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property

from tandem.sampling_params import ParamError, SamplingParams, is_int


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # PD decode side: blocks reserved, the prompt's KV coming from a prefill instance.
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

# One generated position's logprobs: (sampled token id, its logprob, its rank,
# [(top token id, logprob), ...] sorted by logprob descending).
TokenLogprobs = tuple[int, float, int, list[tuple[int, float]]]


@dataclass(eq=False)  # identity: the scheduler's list lookups compare no fields
class Request:
    """A request as the scheduler sees it: tokens, progress and finish state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache (prompt and output alike).
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at the last admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Index i holds the logprobs of prompt token i + 1 (prompt token 0 has none).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Drafts the model runner holds for the next step (speculative decoding).
    num_draft_tokens: int = 0
    # Overlap scheduling: steps scheduled but not yet applied that hold a row of this
    # request, and where the last such row ends and whether it samples.
    num_in_flight: int = 0
    in_flight_end: int = 0
    in_flight_samples: bool = False
    # PD: on a decode instance, the control address of the prefill instance that computes
    # the prompt's KV; on a prefill instance, hold_blocks keeps the blocks after the
    # request finishes, until its KV is handed over.
    remote_prefill: str | None = None
    hold_blocks: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """The output limit; without one, the model's context is the only limit."""
        max_tokens = self.sampling_params.max_tokens
        return max_tokens if max_tokens is not None else 1 << 62

    @cached_property
    def end_token_ids(self) -> set[int]:
        """Tokens that finish the request after min_tokens (its sampling parameters are
        fixed once it exists, so this is computed once, not per generated token)."""
        return self.sampling_params.end_token_ids()

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if not self.status.finished:
            return None
        return self.status.value

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None


@dataclass(frozen=True)
class PromptLimits:
    """What prompts an engine instance can run: the one validation of a prompt, made by the
    engine core and, with the limits the core reported, by the API process for its 400s."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise ParamError (a ValueError naming the field) if the prompt can never run here,
        or if ``params`` name a token id outside the vocabulary."""
        if not isinstance(prompt_token_ids, list):
            raise ParamError("prompt", "prompt token ids must be a list of integers")
        if not prompt_token_ids:
            raise ParamError("prompt", "prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not is_int(t) or not 0 <= t < vocab]
        if bad:
            shown = [t if is_int(t) and abs(t) < 1 << 64 else "..." for t in bad[:5]]
            raise ParamError("prompt", f"prompt token ids outside [0, {vocab}): {shown}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ParamError(
                "prompt",
                f"prompt is {len(prompt_token_ids)} tokens; the context is {self.max_model_len} "
                "and at least one token must be generated",
            )
        needed = -(-(len(prompt_token_ids) + 1) // self.block_size)
        if needed > self.num_kv_blocks:
            raise ParamError(
                "prompt",
                f"prompt is {len(prompt_token_ids)} tokens, more than the KV cache holds "
                f"({self.num_kv_blocks} blocks of {self.block_size})",
            )
        if params is not None:
            params.validate_for_vocab(vocab)
