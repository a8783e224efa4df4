"""De-quantized GGUF weights cached on disk (tandem/models/gguf_weights_cache.py): a second load
gives the first load's tensors bit for bit without de-quantizing; nothing is saved when the
caller stops early or the weights pass the size limit; a damaged entry or an unwritable
cache falls back to de-quantizing; a changed file is de-quantized again. On the default
model, the cached load equals gguf's de-quantization tensor for tensor."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tandem.models import gguf_weights_cache
from tandem.models.gguf_weights_cache import cached_weights


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Dequantizer:
    """Stands in for the de-quantization of a file: three fp32 tensors; counts its runs."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tensors = {
            "model.embed_tokens.weight": torch.randn(50, 8, generator=generator),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
            "model.norm.weight": torch.randn(8, generator=generator),
        }
        self.runs = 0

    def __call__(self):
        self.runs += 1
        yield from self.tensors.items()


def _model_file(tmp_path, content: bytes = b"GGUF stand-in") -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return str(path)


def _entries(cache_dir) -> list[str]:
    folder = cache_dir / "gguf-weights"
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_a_second_load_reads_the_saved_tensors(tmp_path, cache_dir):
    path, source = _model_file(tmp_path), Dequantizer()
    first = dict(cached_weights(path, source))
    assert source.runs == 1 and len(_entries(cache_dir)) == 1
    second = dict(cached_weights(path, source))
    assert source.runs == 1  # not de-quantized again
    assert list(second) == list(source.tensors)
    for name, tensor in source.tensors.items():
        assert torch.equal(first[name], tensor) and torch.equal(second[name], tensor)


def test_a_caller_that_stops_early_saves_nothing(tmp_path, cache_dir):
    path, source = _model_file(tmp_path), Dequantizer()
    weights = cached_weights(path, source)
    next(weights)
    weights.close()  # as when the model refuses a weight and the load raises
    assert _entries(cache_dir) == []
    dict(cached_weights(path, source))
    assert source.runs == 2 and len(_entries(cache_dir)) == 1


def test_weights_over_the_limit_are_not_cached(tmp_path, cache_dir):
    path, source = _model_file(tmp_path), Dequantizer()
    total = sum(t.numel() * 4 for t in source.tensors.values())
    assert len(dict(cached_weights(path, source, max_bytes=total - 1))) == 3
    assert _entries(cache_dir) == []
    dict(cached_weights(path, source, max_bytes=total))
    assert len(_entries(cache_dir)) == 1


def test_a_damaged_entry_is_ignored_and_written_again(tmp_path, cache_dir, caplog):
    path, source = _model_file(tmp_path), Dequantizer()
    dict(cached_weights(path, source))
    entry = cache_dir / "gguf-weights" / _entries(cache_dir)[0]
    entry.write_bytes(entry.read_bytes()[:100])  # cut short
    again = dict(cached_weights(path, source))
    assert source.runs == 2 and "ignoring the cached GGUF weights" in caplog.text
    assert all(torch.equal(again[n], t) for n, t in source.tensors.items())
    dict(cached_weights(path, source))
    assert source.runs == 2  # the rewritten entry is whole


def test_an_unwritable_cache_still_gives_the_weights(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/proc/no-such-place")
    path, source = _model_file(tmp_path), Dequantizer()
    for _ in range(2):
        got = dict(cached_weights(path, source))
        assert all(torch.equal(got[n], t) for n, t in source.tensors.items())
    assert source.runs == 2 and "cannot cache de-quantized GGUF weights" in caplog.text


def test_a_changed_file_is_dequantized_again(tmp_path, cache_dir):
    path, source = _model_file(tmp_path), Dequantizer()
    dict(cached_weights(path, source))
    other = Dequantizer(seed=1)
    _model_file(tmp_path, b"another GGUF stand-in")  # new size and mtime: a new key
    got = dict(cached_weights(path, other))
    assert other.runs == 1 and len(_entries(cache_dir)) == 2
    assert all(torch.equal(got[n], t) for n, t in other.tensors.items())


def test_the_default_model_loads_the_same_weights_from_the_cache(cache_dir, monkeypatch):
    import gguf

    from tandem.models.loader import ModelFiles, _iter_gguf

    files = ModelFiles(None)
    want = dict(_iter_gguf(files._gguf, files.arch))
    first = dict(files.iter_weights())
    assert len(_entries(cache_dir)) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("de-quantized although the weights are cached")

    monkeypatch.setattr(gguf, "dequantize", refuse)
    cached = dict(ModelFiles(None).iter_weights())
    assert list(cached) == list(want) == list(first)
    for name, tensor in want.items():
        assert cached[name].dtype == torch.float32 and torch.equal(cached[name], tensor), name
    assert gguf_weights_cache.MAX_CACHED_BYTES >= sum(t.numel() * 4 for t in want.values())
    shutil.rmtree(cache_dir)  # half a gigabyte that no later run reads
