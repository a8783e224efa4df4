"""scripts/device_pack.py and scripts/device_unpack.sh: what a bare GPU machine gets is what
was packed, the ShareGPT records at their own indices."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess

import pytest

from tandem.bench.datasets import iter_sharegpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _pack_module():
    spec = importlib.util.spec_from_file_location(
        "device_pack", os.path.join(ROOT, "scripts", "device_pack.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compact_sharegpt_keeps_the_head_and_the_held_out_records_at_their_indices(tmp_path):
    pack = _pack_module()
    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(10)
    ]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records)[:-40])  # cut off mid-record, as the shipped file is
    out = str(tmp_path / "compact.json")
    assert pack.compact_sharegpt(str(source), out, 2, 5, 3) == 8
    compact = list(iter_sharegpt(out))
    assert compact[:2] == records[:2] and compact[5:] == records[5:8]
    assert compact[2:5] == [{}, {}, {}]
    with pytest.raises(ValueError, match="holds 9 records, 12 needed"):
        pack.compact_sharegpt(str(source), out, 2, 8, 4)


def test_parts_carried_one_call_each_are_joined_when_all_are_there(tmp_path):
    pack = _pack_module()
    model, data = os.urandom(100_001), os.urandom(50_001)
    (tmp_path / "model").write_bytes(model)
    (tmp_path / "data").write_bytes(data)
    folders = [str(tmp_path / f"packed{i}") for i in (1, 2, 3)]
    for folder in folders:
        os.makedirs(folder)
    pack.split(str(tmp_path / "model"), MODEL, tuple(folders))
    pack.split(str(tmp_path / "data"), "sharegpt.json", tuple(folders[1:]))
    stage, call = tmp_path / "stage", tmp_path / "call"
    env = {**os.environ, "DEVICE_STAGE": str(stage)}
    unpack = f"source {os.path.join(ROOT, 'scripts', 'device_unpack.sh')}; echo $MODEL"
    for i, folder in enumerate(folders, 1):  # one folder carried per call, the rest absent
        shutil.rmtree(call, ignore_errors=True)
        os.makedirs(call)
        os.rename(folder, call / f".gpu{i}")
        done = subprocess.run(
            ["bash", "-c", unpack], cwd=call, env=env, capture_output=True, text=True, check=True
        )
        assert ("joined" in done.stdout) == (i == 3), done.stdout
    assert (stage / MODEL).read_bytes() == model
    assert (stage / "sharegpt.json").read_bytes() == data
    assert done.stdout.strip().endswith(str(stage / MODEL))


def test_the_tokenizer_alone_tokenizes_as_the_model_does(tmp_path):
    """The first call's tokenizer-only GGUF (no tensors) gives the default model's ids, end
    tokens and chat template."""
    from tandem.models.loader import resolve_model
    from tandem.tokenizer import Tokenizer

    pack = _pack_module()
    model = resolve_model(None)
    out = tmp_path / MODEL
    pack.tokenizer_only(model, str(out))
    assert out.stat().st_size < os.path.getsize(model) / 20
    alone, whole = Tokenizer.from_model_path(str(out)), Tokenizer.from_model_path(model)
    text = "Hello, world! <|im_start|>user\nWhat is 2+2?<|im_end|> ünïcödé 🙂"
    assert alone.encode(text) == whole.encode(text)
    assert alone.end_token_ids == whole.end_token_ids and alone.eos_token_id == whole.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert alone.apply_chat_template(chat) == whole.apply_chat_template(chat)
