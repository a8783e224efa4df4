"""A GGUF file's de-quantized weights, saved on disk so that later loads skip the de-quantization.

``gguf.dequantize`` runs in numpy, block by block: about 2 s for SmolLM2-135M's Q4_1 tensors
on a CPU, paid by every engine and every server process that loads the model (more than the
rest of an engine's start). The first load of a file keeps the fp32 tensors it yields (with
llama.cpp's rotary permutation undone, as the model takes them) and, once every tensor went
through, saves them as one safetensors file under ``$TANDEM_CACHE_DIR`` (the tokenizer
cache's root), keyed by the file's absolute path, size and modification time and by gguf's
version; later loads read that file. fp32 is exact (de-quantized values are fp32), so a
cached load gives the same weights bit for bit. Files whose fp32 weights would pass
``MAX_CACHED_BYTES`` are not cached (an 8B model would take 32 GB of disk). A cache that
cannot be written or read is skipped: the weights are de-quantized again.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Callable, Iterator

import torch

from tandem.tokenizer_cache import cache_root, file_digest

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what is saved changes
MAX_CACHED_BYTES = 2 << 30  # fp32 weights of models up to about 500 M parameters

Weights = Iterator[tuple[str, torch.Tensor]]


def cached_weights(
    path: str, dequantize: Callable[[], Weights], max_bytes: int = MAX_CACHED_BYTES
) -> Weights:
    """The weights of the GGUF file at ``path``: from the cache, else ``dequantize()``'s
    (name, fp32 tensor) pairs, saved once the caller has taken them all (a caller that stops
    early, on a misnamed weight say, saves nothing)."""
    entry = _entry(path)
    saved = _load(entry)
    if saved is not None:
        yield from saved.items()
        return
    kept: dict[str, torch.Tensor] | None = {}
    size = 0
    for name, tensor in dequantize():
        if kept is not None:
            size += tensor.numel() * tensor.element_size()
            kept[name] = tensor
            if size > max_bytes:
                kept = None
        yield name, tensor
    if kept:
        _save(entry, kept)


def _entry(path: str) -> str:
    digest = file_digest(path, importlib.metadata.version("gguf"), str(FORMAT_VERSION))
    return os.path.join(cache_root(), "gguf-weights", digest + ".safetensors")


def _load(entry: str) -> dict[str, torch.Tensor] | None:
    """Every tensor of the entry (read whole before any is used), or None."""
    if not os.path.isfile(entry):
        return None
    try:
        from safetensors import safe_open

        with safe_open(entry, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        if not tensors or any(t.dtype != torch.float32 for t in tensors.values()):
            raise ValueError("not a de-quantized weights file")
        return tensors
    except Exception as exc:  # a damaged entry: de-quantize again
        logger.warning("ignoring the cached GGUF weights %s (%s)", entry, exc)
        return None


def _save(entry: str, tensors: dict[str, torch.Tensor]) -> None:
    staging = None
    try:
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(entry), exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".partial-", dir=os.path.dirname(entry))
        os.close(fd)
        save_file({name: t.contiguous() for name, t in tensors.items()}, staging)
        os.replace(staging, entry)  # atomic: readers see no entry or the whole one
        staging = None
    except Exception as exc:  # a read-only home or a full disk: no cache, no failure
        logger.warning("cannot cache de-quantized GGUF weights under %s (%s)", entry, exc)
    finally:
        if staging is not None:
            os.unlink(staging)
