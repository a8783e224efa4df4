"""The wire format of the zmq KV connector: signed write messages, signed answers, and how a
write's block runs are cut into messages.

A write message is one ZeroMQ multipart message ``header | chunk ...``. A chunk is one
contiguous byte range of the cache on both sides: ``chunks[i] = (layer, half, first block,
number of blocks)`` (half 0 keys, 1 values), its frame ``number of blocks x block_bytes``
bytes. The header is ``tag (32 bytes) | time in ms (8) | nonce (8) | msgpack body``, the body
``{"to": receiving instance id, "chunks": [[layer, half, block, n], ...]}``, and the tag is
HMAC-SHA256 over everything after it and then every chunk, each preceded by its length (8
bytes): a chunk cannot be changed, dropped, added or moved without the key. An answer is
``tag (32) | msgpack {"ok": bool, "error": str}``, its tag HMAC-SHA256 under the answer key
over the request's tag and the body: it answers that request only.

Import-light (no torch, no ZeroMQ): the checks are testable on their own.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time

import msgpack

from tandem.disagg.control import FrameError, ReplayGuard

TAG_BYTES = 32
_STAMP = struct.Struct(">Q8s")  # milliseconds since the epoch, nonce
_LENGTH = struct.Struct(">Q")
HEADER_BYTES = TAG_BYTES + _STAMP.size


def answer_key(key: bytes) -> bytes:
    """The key that signs answers (one key per direction)."""
    return hmac.new(key, b"tandem:kv-answer", hashlib.sha256).digest()


def _tag(key: bytes, stamped: bytes, chunks) -> bytes:
    mac = hmac.new(key, stamped, hashlib.sha256)
    for chunk in chunks:
        view = memoryview(chunk)
        mac.update(_LENGTH.pack(view.nbytes))
        mac.update(view)
    return mac.digest()


def sign_write(key: bytes, body: dict, chunks, now_s: float | None = None) -> bytes:
    """The header of a write message carrying ``body`` and ``chunks`` (buffers)."""
    stamped = _STAMP.pack(int((time.time() if now_s is None else now_s) * 1000), os.urandom(8))
    stamped += msgpack.packb(body)
    return _tag(key, stamped, chunks) + stamped


def open_write(key: bytes, header: bytes, chunks, guard: ReplayGuard) -> bytes:
    """The msgpack body of an authentic, fresh write message (not decoded); FrameError if
    the tag, the time or the freshness is wrong. Nothing is decoded before the tag checks."""
    if len(header) < HEADER_BYTES:
        raise FrameError(f"a {len(header)}-byte header, shorter than a signed one")
    tag, stamped = header[:TAG_BYTES], header[TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, stamped, chunks)):
        raise FrameError("bad signature (not signed with this deployment's secret)")
    sent_ms, _ = _STAMP.unpack_from(stamped)
    guard.check(tag, sent_ms / 1000, time.time())
    return stamped[_STAMP.size :]


def sign_answer(key: bytes, request_tag: bytes, ok: bool, error: str = "") -> bytes:
    """The answer to the write message whose tag is ``request_tag``."""
    body = msgpack.packb({"ok": ok, "error": error})
    return hmac.new(answer_key(key), request_tag + body, hashlib.sha256).digest() + body


def open_answer(key: bytes, request_tag: bytes, answer: bytes) -> tuple[bool, str]:
    """``(ok, error)`` of an authentic answer to ``request_tag``; FrameError otherwise."""
    tag, body = answer[:TAG_BYTES], answer[TAG_BYTES:]
    expected = hmac.new(answer_key(key), request_tag + body, hashlib.sha256).digest()
    if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, expected):
        raise FrameError("an answer not signed with this deployment's secret")
    fields = msgpack.unpackb(body)
    return bool(fields["ok"]), str(fields.get("error", ""))


def plan_messages(
    runs: list[tuple[int, int, int]], num_layers: int, block_bytes: int, message_bytes: int
) -> list[list[tuple[int, int, int, int, int]]]:
    """The chunks ``(layer, half, src block, dst block, n)`` of a write of ``runs``
    (``(src_start, dst_start, length)``), grouped into messages of at most ``message_bytes``
    of chunks each (a chunk is at least one block: a larger block goes alone)."""
    per_chunk = max(1, message_bytes // block_bytes)
    messages: list[list[tuple[int, int, int, int, int]]] = []
    current: list[tuple[int, int, int, int, int]] = []
    size = 0
    for layer in range(num_layers):
        for half in (0, 1):
            for src, dst, length in runs:
                for offset in range(0, length, per_chunk):
                    n = min(per_chunk, length - offset)
                    if current and size + n * block_bytes > message_bytes:
                        messages.append(current)
                        current, size = [], 0
                    current.append((layer, half, src + offset, dst + offset, n))
                    size += n * block_bytes
    if current:
        messages.append(current)
    return messages


def checked_chunks(body: bytes, sizes: list[int], instance: str, layout: dict) -> list[tuple]:
    """The ``(layer, half, block, n)`` chunks of an authentic write body, each checked
    against this instance's id and cache ``layout`` (``cache_layout``) and ``sizes`` (the
    bytes of the chunk frames); ValueError naming the first problem."""
    try:
        fields = msgpack.unpackb(body)
    except Exception as error:  # noqa: BLE001 (msgpack raises several types)
        raise ValueError(f"body is not msgpack: {error}") from None
    if not isinstance(fields, dict) or fields.get("to") != instance:
        raise ValueError("addressed to another instance")
    chunks = fields.get("chunks")
    if not isinstance(chunks, list) or len(chunks) != len(sizes):
        raise ValueError(f"{len(sizes)} chunk frames, but the header lists another number")
    num_blocks, block_bytes = layout["num_blocks"], layout["block_bytes"]
    checked = []
    for i, chunk in enumerate(chunks):
        if not (isinstance(chunk, list) and len(chunk) == 4 and all(type(v) is int for v in chunk)):
            raise ValueError(f"chunks[{i}]: expected [layer, half, block, n], got {chunk!r}")
        layer, half, block, n = chunk
        if not 0 <= layer < layout["num_layers"] or half not in (0, 1):
            raise ValueError(f"chunks[{i}]: no layer {layer} half {half} in this cache")
        if n < 1 or block < 0 or block + n > num_blocks:
            raise ValueError(
                f"chunks[{i}]: blocks [{block}, {block + n}) are outside [0, {num_blocks})"
            )
        if sizes[i] != n * block_bytes:
            raise ValueError(f"chunks[{i}]: {sizes[i]} bytes, not {n} x {block_bytes}")
        checked.append((layer, half, block, n))
    return checked
