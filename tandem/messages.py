"""The messages between Tandem's processes, as typed dataclasses (a leaf: no torch).

Three channels use them: the API process and the engine core (requests in, step updates
out), a tensor-parallel leader and its followers (each loop turn's requests), and the PD
control channel between a decode and a prefill instance. On the wire a message is one
msgpack frame ``[type, {field: value}]`` (``tandem.wire``: its encoding, and the checks of
types and ranges that refuse a malformed frame with a :class:`MessageError` naming the field).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tandem.request import PromptLimits, TokenLogprobs
from tandem.sampling_params import SamplingParams
from tandem.step import RequestUpdate
from tandem.wire import (
    MAX_BLOCK_ID,
    MAX_DRAFTS,
    MAX_ERROR_CHARS,
    MAX_ID_CHARS,
    MAX_SEED,
    MAX_TOKEN_ID,
    Message,
    MessageError,
    bounded_text,
    codec_field,
    decode,  # noqa: F401 (re-exported: receivers decode with the messages they expect)
    from_wire,
    ids_in_range,
    logprobs_in_range,
)


def _logprobs_to_wire(entries: list[TokenLogprobs]) -> list:
    return [
        [token, logprob, rank, [list(pair) for pair in top]]
        for token, logprob, rank, top in entries
    ]


def _logprobs_from_wire(entries: list) -> list[TokenLogprobs]:
    return [
        (int(e[0]), float(e[1]), int(e[2]), [(int(t), float(lp)) for t, lp in e[3]])
        for e in entries
    ]


def _update_to_wire(update: RequestUpdate) -> list:
    return [
        update.request_id,
        update.new_token_ids,
        _logprobs_to_wire(update.new_logprobs),
        _logprobs_to_wire(update.new_prompt_logprobs),
        update.finish_reason,
        update.stop_reason,
        update.num_cached_tokens,
        update.error,
    ]


def _update_from_wire(data: list) -> RequestUpdate:
    request_id, tokens, logprobs, prompt_logprobs, finish, stop, cached, error = data
    return RequestUpdate(
        request_id,
        list(tokens),
        _logprobs_from_wire(logprobs),
        _logprobs_from_wire(prompt_logprobs),
        finish,
        stop,
        cached,
        error,
    )


# ---- API process <-> engine core ---------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What an engine core reports once its model is loaded (its limits and role)."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    model_path: str
    role: str = "mixed"
    control_address: str | None = None  # PD roles: where peers send control messages

    @property
    def limits(self) -> PromptLimits:
        """The prompts this engine can run (the core's own validation)."""
        return PromptLimits(
            self.max_model_len, self.vocab_size, self.num_kv_blocks, self.block_size
        )


@dataclass(frozen=True)
class AddRequest(Message):
    """Run a request. ``remote_prefill`` (decode instances): the control address of the
    prefill instance that computes the prompt's KV."""

    TYPE: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = codec_field(SamplingParams.to_dict, SamplingParams.from_dict)
    remote_prefill: str | None = None


@dataclass(frozen=True)
class AbortRequests(Message):
    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass(frozen=True)
class FinishRequest(Message):
    """A stop string matched on the API side: the core finishes the request."""

    TYPE: ClassVar[str] = "finish"
    request_id: str
    stop_string: str


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class EngineReady(Message):
    TYPE: ClassVar[str] = "ready"
    info: EngineInfo = codec_field(dataclasses.asdict, lambda data: EngineInfo(**data))


@dataclass(frozen=True)
class EngineFailed(Message):
    """The engine core could not start (the reason, with its traceback)."""

    TYPE: ClassVar[str] = "failed"
    error: str


@dataclass(frozen=True)
class StepUpdates(Message):
    """One step's request updates and the engine's counters after it."""

    TYPE: ClassVar[str] = "updates"
    updates: list[RequestUpdate] = codec_field(
        lambda updates: [_update_to_wire(u) for u in updates],
        lambda data: [_update_from_wire(u) for u in data],
    )
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AddRejected(Message):
    """The core refused a request (the message says why)."""

    TYPE: ClassVar[str] = "rejected"
    request_id: str
    error: str


@dataclass(frozen=True)
class Heartbeat(Message):
    """Sent by the core's heartbeat thread every ``HEARTBEAT_INTERVAL_S``, idle or busy:
    the core process still runs, and its loop has been in its current turn (a step, or
    waiting for input) for ``turn_age_s`` seconds."""

    TYPE: ClassVar[str] = "heartbeat"
    turn_age_s: float


# ---- tensor-parallel leader -> followers --------------------------------------------------

CLIENT_MESSAGES = (AddRequest, AbortRequests, FinishRequest, Shutdown)


@dataclass(frozen=True)
class Turn(Message):
    """The client messages a leader took in one loop turn, for every follower to handle."""

    TYPE: ClassVar[str] = "turn"
    messages: list[Message] = codec_field(
        lambda messages: [m.to_wire() for m in messages],
        lambda data: [from_wire(m, CLIENT_MESSAGES) for m in data],
    )


# ---- PD control channel -----------------------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """What a decode instance needs beyond the KV to continue a request exactly as the
    prefill instance would: its MTP drafts (their distributions when sampled, fp32 bytes of
    ``draft_probs_shape``) and the 63-bit key seed of its random numbers (drawn by the
    prefill instance for an unseeded request)."""

    drafts: list[int] = field(default_factory=list)
    draft_probs: bytes | None = None
    draft_probs_shape: list[int] | None = None
    seed: int | None = None

    def check(self, kind: str) -> None:
        """MessageError for drafts, probabilities or a seed out of range."""
        if len(self.drafts) > MAX_DRAFTS:
            raise MessageError(f"{kind}.handoff: more than {MAX_DRAFTS} drafts")
        ids_in_range(kind, "handoff.drafts", self.drafts, 0, MAX_TOKEN_ID)
        if self.seed is not None:
            ids_in_range(kind, "handoff.seed", [self.seed], 0, MAX_SEED)
        if (self.draft_probs is None) != (self.draft_probs_shape is None):
            raise MessageError(f"{kind}.handoff: draft_probs and its shape come together")
        if self.draft_probs_shape is not None:
            shape = self.draft_probs_shape
            if not 1 <= len(shape) <= 3 or any(size < 1 for size in shape):
                raise MessageError(f"{kind}.handoff.draft_probs_shape: {shape} is not a shape")
            if len(self.draft_probs) != 4 * math.prod(shape):
                raise MessageError(
                    f"{kind}.handoff.draft_probs: {len(self.draft_probs)} bytes, not fp32 "
                    f"of shape {shape}"
                )


@dataclass(frozen=True)
class PrefillTask(Message):
    """Decode -> prefill: run the prompt, write its KV into ``dst_blocks`` of the cache that
    ``kv`` (the decode side's connector descriptor) describes, answer ``reply_to``."""

    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = codec_field(SamplingParams.to_dict, SamplingParams.from_dict)
    kv: dict[str, Any] = field(default_factory=dict)
    dst_blocks: list[int] = field(default_factory=list)
    reply_to: str = ""
    timeout_s: float = 30.0

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)
        bounded_text(self.TYPE, "reply_to", self.reply_to, MAX_ID_CHARS)
        if not self.reply_to.startswith("tcp://"):
            raise MessageError(f"{self.TYPE}.reply_to: expected a tcp:// address")
        if not self.prompt_token_ids:
            raise MessageError(f"{self.TYPE}.prompt_token_ids: empty")
        ids_in_range(self.TYPE, "prompt_token_ids", self.prompt_token_ids, 0, MAX_TOKEN_ID)
        ids_in_range(self.TYPE, "dst_blocks", self.dst_blocks, 0, MAX_BLOCK_ID)
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise MessageError(f"{self.TYPE}.timeout_s: expected a positive finite number")


@dataclass(frozen=True)
class PrefillCancel(Message):
    TYPE: ClassVar[str] = "cancel"
    request_id: str

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)


@dataclass(frozen=True)
class PrefillStarted(Message):
    """Prefill -> decode: the request runs now (the decode side's timeout restarts)."""

    TYPE: ClassVar[str] = "started"
    request_id: str

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)


@dataclass(frozen=True)
class KVTransferring(Message):
    """Prefill -> decode: the first token is done and the KV write begins."""

    TYPE: ClassVar[str] = "transferring"
    request_id: str

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)


@dataclass(frozen=True)
class KVReady(Message):
    """Prefill -> decode: the KV is written; the first token, its logprobs and the rest."""

    TYPE: ClassVar[str] = "kv_ready"
    request_id: str
    token_id: int
    logprobs: list[TokenLogprobs] = codec_field(_logprobs_to_wire, _logprobs_from_wire)
    prompt_logprobs: list[TokenLogprobs] = codec_field(_logprobs_to_wire, _logprobs_from_wire)
    num_cached_tokens: int = 0
    handoff: Handoff = codec_field(
        dataclasses.asdict, lambda data: Handoff(**data), default_factory=Handoff
    )

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)
        ids_in_range(self.TYPE, "token_id", [self.token_id], 0, MAX_TOKEN_ID)
        if self.num_cached_tokens < 0:
            raise MessageError(f"{self.TYPE}.num_cached_tokens: negative")
        logprobs_in_range(self.TYPE, "logprobs", self.logprobs)
        logprobs_in_range(self.TYPE, "prompt_logprobs", self.prompt_logprobs)
        self.handoff.check(self.TYPE)


@dataclass(frozen=True)
class KVFailed(Message):
    """Prefill -> decode: the request failed there (the blocks may be reused)."""

    TYPE: ClassVar[str] = "kv_failed"
    request_id: str
    error: str

    def check(self) -> None:
        bounded_text(self.TYPE, "request_id", self.request_id, MAX_ID_CHARS)
        bounded_text(self.TYPE, "error", self.error, MAX_ERROR_CHARS, nonempty=False)


TO_PREFILL = (PrefillTask, PrefillCancel)
TO_DECODE = (PrefillStarted, KVTransferring, KVReady, KVFailed)
TO_ENGINE = (*CLIENT_MESSAGES, Turn)
TO_CLIENT = (EngineReady, EngineFailed, StepUpdates, AddRejected, Heartbeat)
