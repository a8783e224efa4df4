"""The messages between Tandem's processes, as typed dataclasses (a leaf: no torch).

Three channels use them: the API process and the engine core (requests in, step updates
out), a tensor-parallel leader and its followers (each loop turn's requests), and the PD
control channel between a decode and a prefill instance. On the wire a message is one
msgpack frame ``[type, {field: value}]``; :func:`decode` checks the type against what the
receiver expects, every field's presence and basic type, and raises :class:`MessageError`
(naming the field) for anything else, so a malformed frame never reaches the engine.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tandem.request import PromptLimits, TokenLogprobs
from tandem.sampling_params import SamplingParams
from tandem.step import RequestUpdate


class MessageError(ValueError):
    """A frame that is not a well-formed message of an expected type."""


def _codec(encode, decode, **options):
    """A field whose value is converted by ``encode`` for the wire and ``decode`` back."""
    return field(metadata={"codec": (encode, decode)}, **options)


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


@dataclass(frozen=True)
class Message:
    """A message of one of the channels; ``TYPE`` names it on the wire."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> list:
        """``[type, {field: value}]`` of plain data."""
        values = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            codec = spec.metadata.get("codec")
            values[spec.name] = (
                codec[0](value) if codec is not None and value is not None else value
            )
        return [self.TYPE, values]

    def encode(self) -> bytes:
        """The message as one msgpack frame."""
        return msgpack.packb(self.to_wire(), use_bin_type=True)


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
    params: SamplingParams = _codec(SamplingParams.to_dict, SamplingParams.from_dict)
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
    info: EngineInfo = _codec(dataclasses.asdict, lambda data: EngineInfo(**data))


@dataclass(frozen=True)
class EngineFailed(Message):
    """The engine core could not start (the reason, with its traceback)."""

    TYPE: ClassVar[str] = "failed"
    error: str


@dataclass(frozen=True)
class StepUpdates(Message):
    """One step's request updates and the engine's counters after it."""

    TYPE: ClassVar[str] = "updates"
    updates: list[RequestUpdate] = _codec(
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
    messages: list[Message] = _codec(
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


@dataclass(frozen=True)
class PrefillTask(Message):
    """Decode -> prefill: run the prompt, write its KV into ``dst_blocks`` of the cache that
    ``kv`` (the decode side's connector descriptor) describes, answer ``reply_to``."""

    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = _codec(SamplingParams.to_dict, SamplingParams.from_dict)
    kv: dict[str, Any] = field(default_factory=dict)
    dst_blocks: list[int] = field(default_factory=list)
    reply_to: str = ""
    timeout_s: float = 30.0


@dataclass(frozen=True)
class PrefillCancel(Message):
    TYPE: ClassVar[str] = "cancel"
    request_id: str


@dataclass(frozen=True)
class PrefillStarted(Message):
    """Prefill -> decode: the request runs now (the decode side's timeout restarts)."""

    TYPE: ClassVar[str] = "started"
    request_id: str


@dataclass(frozen=True)
class KVTransferring(Message):
    """Prefill -> decode: the first token is done and the KV write begins."""

    TYPE: ClassVar[str] = "transferring"
    request_id: str


@dataclass(frozen=True)
class KVReady(Message):
    """Prefill -> decode: the KV is written; the first token, its logprobs and the rest."""

    TYPE: ClassVar[str] = "kv_ready"
    request_id: str
    token_id: int
    logprobs: list[TokenLogprobs] = _codec(_logprobs_to_wire, _logprobs_from_wire)
    prompt_logprobs: list[TokenLogprobs] = _codec(_logprobs_to_wire, _logprobs_from_wire)
    num_cached_tokens: int = 0
    handoff: Handoff = _codec(
        dataclasses.asdict, lambda data: Handoff(**data), default_factory=Handoff
    )


@dataclass(frozen=True)
class KVFailed(Message):
    """Prefill -> decode: the request failed there (the blocks may be reused)."""

    TYPE: ClassVar[str] = "kv_failed"
    request_id: str
    error: str


TO_PREFILL = (PrefillTask, PrefillCancel)
TO_DECODE = (PrefillStarted, KVTransferring, KVReady, KVFailed)
TO_ENGINE = (*CLIENT_MESSAGES, Turn)
TO_CLIENT = (EngineReady, EngineFailed, StepUpdates, AddRejected, Heartbeat)


# ---- decoding -----------------------------------------------------------------------------


def _type_ok(value, hint) -> bool:
    """Whether ``value`` has the outer type ``hint`` names (lists' and dicts' items
    unchecked; ints pass for floats)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    outer = origin or hint
    if outer is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if outer is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, outer) if isinstance(outer, type) else True


def from_wire(data, expected: tuple[type[Message], ...]) -> Message:
    """The message of ``[type, {field: value}]`` data, if its type is one of ``expected``
    and its fields are well formed; MessageError otherwise."""
    if not (isinstance(data, (list, tuple)) and len(data) == 2 and isinstance(data[1], dict)):
        raise MessageError("a message is [type, {fields}]")
    kind, values = data
    cls = next((c for c in expected if c.TYPE == kind), None)
    if cls is None:
        names = ", ".join(c.TYPE for c in expected)
        raise MessageError(f"unexpected message type {kind!r} (expected one of: {names})")
    specs = {spec.name: spec for spec in dataclasses.fields(cls)}
    unknown = sorted(str(name) for name in values if name not in specs)
    if unknown:
        raise MessageError(f"{kind}: unknown fields {unknown}")
    hints = typing.get_type_hints(cls)
    arguments = {}
    for name, spec in specs.items():
        if name not in values:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise MessageError(f"{kind}: missing field {name!r}")
            continue
        value = values[name]
        codec = spec.metadata.get("codec")
        try:
            if codec is not None and value is not None:
                value = codec[1](value)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise MessageError(f"{kind}.{name}: {e}") from e
        if not _type_ok(value, hints[name]):
            raise MessageError(f"{kind}.{name}: expected {hints[name]}, got {type(value).__name__}")
        arguments[name] = value
    return cls(**arguments)


def decode(frame: bytes, expected: tuple[type[Message], ...]) -> Message:
    """The message in one msgpack frame (see :func:`from_wire`)."""
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        # TypeError: a map whose key is a list or a map (unhashable).
        raise MessageError(f"not a msgpack frame: {e}") from e
    return from_wire(data, expected)
