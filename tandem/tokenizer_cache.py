"""Tokenizers converted from GGUF files, saved on disk so later loads skip the conversion.

Converting a GGUF file's vocabulary into a fast tokenizer (transformers' GGUF reader) and
reading its end-token metadata parse every metadata field of the file: about 13 s for
SmolLM2 on a CPU, paid by every engine and every server process that loads it. The result
is saved once with ``save_pretrained`` (and the metadata as JSON) under
``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``), keyed by the file's absolute path, size
and modification time and by the transformers version; a later load reads it in well under
a second. A cache that cannot be written or read is skipped: the conversion runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_META_FILE = "tandem_gguf_metadata.json"
FORMAT_VERSION = 1  # bump when what is saved changes


def cache_root() -> str:
    """Where converted tokenizers are kept."""
    root = os.environ.get("TANDEM_CACHE_DIR")
    return root or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


def file_digest(path: str, *versions: str) -> str:
    """A cache key for the file at ``path`` as it is now (absolute path, size, modification
    time) read by the code of ``versions``: any change to either gives another key."""
    stat = os.stat(path)
    key = "\0".join([os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns), *versions])
    return hashlib.sha256(key.encode()).hexdigest()


def _entry(path: str) -> str:
    """The cache folder of the GGUF file at ``path`` as it is now, converted by this
    version of transformers in this format."""
    import transformers

    digest = file_digest(path, transformers.__version__, str(FORMAT_VERSION))
    return os.path.join(cache_root(), "gguf-tokenizers", digest)


def load(path: str) -> tuple[PreTrainedTokenizerBase, dict[str, Any]] | None:
    """The saved tokenizer and metadata of the GGUF file at ``path``, or None."""
    from transformers import AutoTokenizer

    entry = _entry(path)
    meta_path = os.path.join(entry, _META_FILE)
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        return AutoTokenizer.from_pretrained(entry), meta
    except Exception as exc:  # a damaged entry: convert again
        logger.warning("ignoring the cached tokenizer in %s (%s)", entry, exc)
        return None


def save(path: str, hf: PreTrainedTokenizerBase, meta: dict[str, Any]) -> None:
    """Save ``hf`` and ``meta`` for the GGUF file at ``path`` (atomically: a folder written
    aside, then renamed; another process's entry is kept)."""
    entry = _entry(path)
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(entry))
        try:
            hf.save_pretrained(staging)
            with open(os.path.join(staging, _META_FILE), "w", encoding="utf-8") as f:
                json.dump(meta, f)
            os.rename(staging, entry)
        except OSError:
            if not os.path.isdir(entry):
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # a read-only home: no cache, no failure
        logger.warning("cannot cache the tokenizer of %s under %s (%s)", path, entry, exc)
