"""Tandem's messages on the wire (a leaf: no torch): the ``Message`` base, its msgpack
frame ``[type, {field: value}]``, and the checks that refuse a malformed frame.

:func:`decode` checks the type against what the receiver expects, every field's presence
and type (the items of lists and dicts and the fields of nested dataclasses too), then the
message's own ranges (``Message.check``), and raises :class:`MessageError` naming the field
for anything else, so a malformed frame never reaches the engine. The messages themselves
are in ``tandem.messages``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tandem.request import TokenLogprobs
from tandem.sampling_params import SamplingParams


class MessageError(ValueError):
    """A frame that is not a well-formed message of an expected type."""


def codec_field(encode, decode, **options):
    """A field whose value is converted by ``encode`` for the wire and ``decode`` back."""
    return field(metadata={"codec": (encode, decode)}, **options)


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

    def check(self) -> None:
        """Raise MessageError naming a field whose value is out of range (types are checked
        by :func:`from_wire` already); the PD control messages bound theirs."""


# Bounds of the PD control messages' fields (what a peer may claim at most).
MAX_ID_CHARS = 512  # request ids, addresses
MAX_ERROR_CHARS = 64 * 1024
MAX_TOKEN_ID = 2**31 - 1  # above any vocabulary; the decode side checks its own vocab size
MAX_BLOCK_ID = 2**31 - 1
MAX_DRAFTS = 64
MAX_SEED = 2**63 - 1


def bounded_text(kind: str, name: str, value: str, limit: int, nonempty: bool = True) -> None:
    if (nonempty and not value) or len(value) > limit:
        raise MessageError(f"{kind}.{name}: expected 1 to {limit} characters, got {len(value)}")


def ids_in_range(kind: str, name: str, values, low: int, high: int) -> None:
    for value in values:
        if not low <= value <= high:
            raise MessageError(f"{kind}.{name}: {value} is outside [{low}, {high}]")


def logprobs_in_range(kind: str, name: str, entries: list[TokenLogprobs]) -> None:
    for token, logprob, rank, top in entries:
        ids_in_range(kind, name, [token, *(t for t, _ in top)], 0, MAX_TOKEN_ID)
        if rank < 1 or any(math.isnan(lp) or lp > 1e-4 for lp in [logprob, *(lp for _, lp in top)]):
            raise MessageError(f"{kind}.{name}: a logprob above 0 or NaN, or a rank below 1")


def _type_ok(value, hint) -> bool:
    """Whether ``value`` has the type ``hint`` names: the items of lists, tuples and dicts
    and the fields of dataclasses too (ints pass for floats; bools are not ints)."""
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
    if not isinstance(outer, type):
        return True
    if not isinstance(value, outer):
        return False
    args = typing.get_args(hint)
    if outer is list and args:
        return all(_type_ok(item, args[0]) for item in value)
    if outer is tuple and args and args[-1] is not Ellipsis:
        return len(value) == len(args) and all(map(_type_ok, value, args))
    if outer is dict and len(args) == 2:
        return all(_type_ok(k, args[0]) and _type_ok(v, args[1]) for k, v in value.items())
    if dataclasses.is_dataclass(outer) and outer is not SamplingParams:  # it checks itself
        return _fields_wrong(value) is None
    return True


def _fields_wrong(value) -> str | None:
    """The name of the first field of dataclass ``value`` whose type is wrong, or None."""
    hints = typing.get_type_hints(type(value))
    for spec in dataclasses.fields(value):
        if not _type_ok(getattr(value, spec.name), hints[spec.name]):
            return spec.name
    return None


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
    message = cls(**arguments)
    message.check()
    return message


def decode(frame: bytes, expected: tuple[type[Message], ...]) -> Message:
    """The message in one msgpack frame (see :func:`from_wire`)."""
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        # TypeError: a map whose key is a list or a map (unhashable).
        raise MessageError(f"not a msgpack frame: {e}") from e
    return from_wire(data, expected)
