"""GGUF files' directories cached on disk (tandem/models/gguf_index.py): a cached open gives
what gguf's own reader gives (scalar fields, array lengths, every tensor's bytes) without
running that reader; a damaged entry or an unwritable cache falls back to parsing; a changed
file is parsed again."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from tandem.models import gguf_index
from tandem.models.gguf_index import open_gguf


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_token_list([f"tok{i}" for i in range(300)])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((300, 32), dtype=np.float32))
    quantized = gguf.quantize(rng.standard_normal((8, 64), dtype=np.float32), 8)  # Q8_0
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_shape=quantized.shape, raw_dtype=8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reader_view(path) -> tuple[dict, dict, dict]:
    reader = gguf.GGUFReader(str(path))
    scalars, arrays = {}, {}
    for key, field in reader.fields.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            arrays[key] = len(field.data)
        else:
            scalars[key] = field.contents()
    tensors = {t.name: (t.tensor_type, np.array(t.data)) for t in reader.tensors}
    return scalars, arrays, tensors


def _assert_same_as_reader(index, path, view=None) -> None:
    scalars, arrays, tensors = view or _reader_view(path)
    assert index.fields == scalars and index.array_lengths == arrays
    assert index.array_lengths["tokenizer.ggml.tokens"] == 300
    got = index.tensors()
    assert [t.name for t in got] == list(tensors)
    for tensor in got:
        kind, data = tensors[tensor.name]
        assert tensor.tensor_type == kind and tensor.data.dtype == data.dtype
        np.testing.assert_array_equal(tensor.data, data)


def test_a_cached_open_gives_what_the_reader_gives_without_it(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    view = _reader_view(path)
    _assert_same_as_reader(open_gguf(str(path)), path, view)
    assert len(os.listdir(cache_dir / "gguf-index")) == 1

    def no_reader(*args, **kwargs):
        raise AssertionError("the cached open parsed the file")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    _assert_same_as_reader(open_gguf(str(path)), path, view)


def test_a_damaged_entry_or_an_unwritable_cache_falls_back_to_parsing(
    tmp_path, cache_dir, monkeypatch
):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    open_gguf(str(path))
    (entry,) = (cache_dir / "gguf-index").iterdir()
    entry.write_text('{"fields": ')
    _assert_same_as_reader(open_gguf(str(path)), path)
    assert entry.read_text().startswith('{"fields": {')  # written again, whole
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/proc/no-such-place")
    _assert_same_as_reader(open_gguf(str(path)), path)


def test_a_changed_file_is_parsed_again(tmp_path, cache_dir):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    open_gguf(str(path))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    open_gguf(str(path))
    assert len(os.listdir(cache_dir / "gguf-index")) == 2


def test_a_tensor_past_the_end_of_a_cached_file_is_named(tmp_path, cache_dir):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    index = open_gguf(str(path))
    saved = index.as_dict()
    saved["tensors"][0]["offset"] = os.path.getsize(path)
    with pytest.raises(ValueError, match="token_embd.weight.*past its end"):
        gguf_index.GGUFIndex(str(path), **saved).tensors()
