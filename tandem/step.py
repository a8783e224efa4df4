"""The messages of one engine step, between the scheduler, the model runner, the engine core
and the output processor (a leaf: plain Python, no torch).

A scheduled step is {request: number of new tokens} plus the drafts the runner holds:
prefill, chunked prefill, decode and verification are one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.request import Request, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One row of a step: compute up to ``num_new_tokens`` tokens of the request.

    For a prompt chunk the count is exact. For a decode row it is the room for the last token
    and its drafts; the model runner, which holds the drafts (and with overlap scheduling is
    a step ahead of the scheduler), decides how many run. A request that (re)enters the
    running set carries a snapshot of its tokens and of its KV already in the cache.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    # The scheduler's view when it made the row: the first position and whether the row
    # samples (a follow-up row's true start is known to the runner only).
    start: int = 0
    samples: bool = True
    follow_up: bool = False  # made while a step of the request that samples is in flight
    reset_token_ids: list[int] | None = None
    reset_num_computed: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    scheduled: list[ScheduledRequest]
    # Requests that finished since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def reads_output(self) -> bool:
        """Whether a row decides its tokens from its output so far (a bias, a penalty, a
        grammar: ``SamplingParams.reads_output``)."""
        return any(row.request.sampling_params.reads_output for row in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model runner produced for one step, keyed by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: drafts the runner holds for each request's next step, and the
    # drafts verified in this step (the accepted ones are the sampled tokens but one).
    num_drafts: dict[str, int] = field(default_factory=dict)
    num_verified_drafts: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """New results of one request after a step (what the engine core sends out)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    new_prompt_logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why a request that finished with "error" failed
