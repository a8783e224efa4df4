"""MTP draft head files and sources: Tandem head files (save/read round trip, errors, shape
checks, layers per draft depth), the dummy head, and models without MTP layers, which need a
speculative_model. Tiny shapes (the ``dummy:tiny`` preset), CPU."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from mtp_head_helpers import (
    TINY,
    assert_same_params,
    hf_config,
    make_rotary,
    random_head,
    target_tensors,
    write_checkpoint,
)

from tandem.models.loader import ModelFiles
from tandem.models.mtp import MTPHead, load_mtp_head
from tandem.models.mtp_files import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, read_head_file, save_head
from tandem.models.registry import ModelArchConfig

# ---- Tandem head files ---------------------------------------------------------------------


def test_save_and_read_head_round_trip(tmp_path):
    reference = random_head(TINY, 2, seed=1)
    save_head(reference, str(tmp_path), "dummy:tiny", extra={"note": "test"})
    with open(tmp_path / HEAD_CONFIG_FILE) as f:
        config = json.load(f)
    assert config["num_layers"] == 2
    assert config["base_model"] == "dummy:tiny"
    assert config["hidden_size"] == TINY.hidden_size
    assert config["note"] == "test"

    num_layers, tensors = read_head_file(str(tmp_path))
    assert num_layers == 2
    loaded = MTPHead(TINY, num_layers, make_rotary(TINY))
    loaded.load_weights(tensors)
    assert_same_params(loaded, reference)

    files = ModelFiles("dummy:tiny")
    via_loader = load_mtp_head(str(tmp_path), files, make_rotary(TINY))
    assert via_loader.num_layers == 2
    assert_same_params(via_loader, reference)


def test_export_names_are_tandem_names_with_split_qkv():
    names = set(random_head(TINY, 1, seed=0).export_weights())
    assert {
        "layers.0.enorm.weight",
        "layers.0.hnorm.weight",
        "layers.0.eh_proj.weight",
        "layers.0.final_norm.weight",
        "layers.0.block.self_attn.q_proj.weight",
        "layers.0.block.self_attn.k_proj.weight",
        "layers.0.block.self_attn.v_proj.weight",
        "layers.0.block.mlp.down_proj.weight",
    } <= names
    assert not any("qkv_proj" in n for n in names)


def test_a_head_with_gate_and_up_fused_exports_them_apart():
    """On the GPU the head's MLPs run one gate-up matrix (``MTPHead.fuse_gate_up``); what it
    exports loads into an unfused head with the same weights."""
    head = random_head(TINY, 2, seed=3)
    reference = {name: t.clone() for name, t in head.export_weights().items()}
    head.fuse_gate_up()
    exported = head.export_weights()
    assert not any("gate_up_proj" in n for n in exported)
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("missing", [HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE])
def test_read_head_missing_file_names_it(tmp_path, missing):
    save_head(random_head(TINY, 1, seed=0), str(tmp_path), "dummy:tiny")
    os.remove(tmp_path / missing)
    with pytest.raises(ValueError, match=missing):
        read_head_file(str(tmp_path))


def test_read_head_corrupt_weights_names_file(tmp_path):
    save_head(random_head(TINY, 1, seed=0), str(tmp_path), "dummy:tiny")
    (tmp_path / HEAD_WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match=HEAD_WEIGHTS_FILE):
        read_head_file(str(tmp_path))


def test_missing_head_dir_is_value_error(tmp_path):
    """A wrong speculative_model path fails with read_head_file's ValueError."""
    files = ModelFiles("dummy:tiny")
    with pytest.raises(ValueError, match=HEAD_CONFIG_FILE):
        load_mtp_head(str(tmp_path / "no-such-head"), files, make_rotary(files.arch))


def test_head_for_another_shape_is_rejected(tmp_path):
    save_head(random_head(TINY, 1, seed=0), str(tmp_path), "dummy:tiny")
    other = dataclasses.replace(TINY, hidden_size=32, intermediate_size=64)
    _, tensors = read_head_file(str(tmp_path))
    with pytest.raises(ValueError, match="shape"):
        MTPHead(other, 1, make_rotary(other)).load_weights(tensors)


def test_head_needs_a_layer():
    with pytest.raises(ValueError):
        MTPHead(TINY, 0, make_rotary(TINY))


def test_last_layer_repeats_for_deeper_drafts():
    head = MTPHead(TINY, 2, make_rotary(TINY))
    assert [head.layer_for_depth(d) for d in range(4)] == [0, 1, 1, 1]


# ---- dummy head and models without MTP -----------------------------------------------------


def test_dummy_head():
    files = ModelFiles("dummy:tiny")
    head = load_mtp_head("dummy", files, make_rotary(files.arch))
    assert head.num_layers == 1
    params = dict(head.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert torch.equal(params["layers.0.enorm.weight"], torch.ones(TINY.hidden_size))
    assert params["layers.0.eh_proj.weight"].abs().max() <= 0.05
    again = load_mtp_head("dummy", files, make_rotary(files.arch))
    assert_same_params(again, head)  # seeded
    other = load_mtp_head("dummy", files, make_rotary(files.arch), seed=1)
    assert not torch.equal(other.layers[0].eh_proj.weight, head.layers[0].eh_proj.weight)


def test_model_without_mtp_needs_speculative_model():
    files = ModelFiles("dummy:tiny")
    with pytest.raises(ValueError, match="speculative_model"):
        load_mtp_head(None, files, make_rotary(files.arch))


def test_checkpoint_without_mtp_needs_speculative_model(tmp_path):
    arch = ModelArchConfig.from_hf_config(hf_config("LlamaForCausalLM"))
    _, tensors = target_tensors(arch, seed=6)
    write_checkpoint(tmp_path, "LlamaForCausalLM", {"model.safetensors": tensors})
    files = ModelFiles(str(tmp_path))
    with pytest.raises(ValueError, match="speculative_model"):
        load_mtp_head(None, files, make_rotary(files.arch))
