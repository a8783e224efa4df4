"""A GGUF file's directory (its scalar metadata and where each tensor lies), saved on disk so
that later opens skip the ``gguf`` package's full parse.

``gguf.GGUFReader`` parses every metadata field when it opens a file, the tokenizer's
vocabulary and merges too (about 100,000 strings for SmolLM2: 7 s on a CPU), and every engine
process opens its model. The first open reads the file with ``GGUFReader`` and saves the
scalar fields, the array fields' lengths and each tensor's name, quantization type, numpy
dtype, shape and byte offset as JSON under ``$TANDEM_CACHE_DIR`` (the tokenizer cache's
root), keyed by the file's absolute path, size and modification time and by gguf's version;
later opens map the tensors at those offsets. A cache that cannot be written or read is
skipped: the file is parsed again.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.tokenizer_cache import cache_root, file_digest

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what is saved changes


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``data`` as stored (quantized types as bytes per row)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFIndex:
    """What the loader reads from a GGUF file: scalar metadata, array lengths, tensors."""

    def __init__(self, path: str, fields: dict, array_lengths: dict, tensors: list[dict]):
        self.path, self.fields, self.array_lengths = path, fields, array_lengths
        self._tensors = tensors

    def field(self, key: str, default=None):
        """A scalar metadata field's value (``default`` when absent or an array)."""
        return self.fields.get(key, default)

    @property
    def tensor_names(self) -> set[str]:
        return {t["name"] for t in self._tensors}

    def as_dict(self) -> dict:
        """What the cache saves (and ``GGUFIndex(path, **saved)`` rebuilds)."""
        return {
            "fields": self.fields,
            "array_lengths": self.array_lengths,
            "tensors": self._tensors,
        }

    def tensors(self) -> list[GGUFTensor]:
        """The tensors, mapped read-only from the file."""
        from gguf import GGMLQuantizationType

        whole = np.memmap(self.path, dtype=np.uint8, mode="r")
        out = []
        for t in self._tensors:
            dtype = np.dtype(t["dtype"])
            count = int(np.prod(t["shape"]))
            end = t["offset"] + count * dtype.itemsize
            if end > whole.size:
                raise ValueError(f"GGUF file {self.path!r}: tensor {t['name']!r} lies past its end")
            data = whole[t["offset"] : end].view(dtype).reshape(t["shape"])
            out.append(GGUFTensor(t["name"], GGMLQuantizationType(t["type"]), data))
        return out


def open_gguf(path: str) -> GGUFIndex:
    """The index of the GGUF file at ``path`` (from the cache, else parsed and cached);
    ValueError naming the file when it cannot be read."""
    entry = _entry(path)
    cached = _load(path, entry)
    if cached is not None:
        return cached
    try:
        from gguf import GGUFReader, GGUFValueType

        reader = GGUFReader(path)
    except Exception as e:  # the reader raises many kinds of errors on bad files
        raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
    fields, array_lengths = {}, {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            array_lengths[key] = len(field.data)
        else:
            fields[key] = field.contents()
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "dtype": t.data.dtype.str,
            "shape": list(t.data.shape),
            "offset": int(t.data_offset),
        }
        for t in reader.tensors
    ]
    index = GGUFIndex(path, fields, array_lengths, tensors)
    _save(entry, index)
    return index


def _entry(path: str) -> str:
    digest = file_digest(path, importlib.metadata.version("gguf"), str(FORMAT_VERSION))
    return os.path.join(cache_root(), "gguf-index", digest + ".json")


def _load(path: str, entry: str) -> GGUFIndex | None:
    if not os.path.isfile(entry):
        return None
    try:
        with open(entry, encoding="utf-8") as f:
            saved = json.load(f)
        return GGUFIndex(path, **saved)
    except Exception as exc:  # a damaged entry: parse again
        logger.warning("ignoring the cached GGUF index %s (%s)", entry, exc)
        return None


def _save(entry: str, index: GGUFIndex) -> None:
    staging = None
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".partial-", dir=os.path.dirname(entry))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(index.as_dict(), f)
        os.replace(staging, entry)  # atomic: readers see the old entry or the whole new one
        staging = None
    except Exception as exc:  # a read-only home: no cache, no failure
        logger.warning("cannot cache the GGUF index of %s under %s (%s)", index.path, entry, exc)
    finally:
        if staging is not None:
            os.unlink(staging)
