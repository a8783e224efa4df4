"""MTP draft head: Tandem head files (save/read round trip, errors), the MiMo and DeepSeek-V3
checkpoint layouts (MTP layers stored beside the target's weights), the dummy head, and one
MTP layer's forward over a paged KV cache. Tiny shapes (the ``dummy:tiny`` preset), CPU."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tandem.layers.attention import TorchAttentionBackend
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import LlamaModel, split_fused_weights
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import (
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    MTPHead,
    load_mtp_head,
    read_head_file,
    rename_deepseek,
    rename_mimo,
    save_head,
)
from tandem.models.registry import ModelArchConfig, dummy_preset

MAX_POSITION = 64
TINY = dummy_preset("tiny")  # vocab 512, hidden 64, intermediate 128, 2 layers, 4/2 heads, d 16


def make_rotary(arch: ModelArchConfig) -> RotaryEmbedding:
    return RotaryEmbedding(arch.head_dim, MAX_POSITION, arch.rope_theta, arch.rope_scaling)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Distinct random values in every parameter, norms included."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def random_head(arch: ModelArchConfig, num_layers: int, seed: int) -> MTPHead:
    head = MTPHead(arch, num_layers, make_rotary(arch))
    randomize(head, seed)
    return head


def assert_same_params(actual: torch.nn.Module, expected: torch.nn.Module, skip=()) -> None:
    got, want = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    for name, param in want.items():
        if name in skip:
            continue
        assert torch.equal(got[name].detach(), param.detach()), f"{name} differs"


def hf_config(architecture: str) -> dict:
    return {
        "architectures": [architecture],
        "vocab_size": TINY.vocab_size,
        "hidden_size": TINY.hidden_size,
        "intermediate_size": TINY.intermediate_size,
        "num_hidden_layers": TINY.num_layers,
        "num_attention_heads": TINY.num_heads,
        "num_key_value_heads": TINY.num_kv_heads,
        "head_dim": TINY.head_dim,
        "rope_theta": TINY.rope_theta,
        "rms_norm_eps": TINY.rms_norm_eps,
        "max_position_embeddings": TINY.max_position_embeddings,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    }


def target_tensors(arch: ModelArchConfig, seed: int) -> tuple[LlamaModel, dict[str, torch.Tensor]]:
    """A random target model and its weights under Hugging Face names."""
    model = LlamaModel(arch, MAX_POSITION)
    randomize(model, seed)
    tensors = {
        name if name == "lm_head.weight" else "model." + name: tensor
        for name, tensor in split_fused_weights(model, arch).items()
    }
    return model, tensors


def to_mimo(name: str, tensor: torch.Tensor, hidden: int) -> tuple[str, torch.Tensor]:
    """A Tandem head tensor under its MiMo checkpoint name (and layout)."""
    _, index, rest = name.split(".", 2)
    prefix = f"model.mtp_layers.{index}."
    if rest.startswith("block."):
        return prefix + rest.removeprefix("block."), tensor
    module, kind = rest.split(".", 1)
    if module == "eh_proj":
        # MiMo's input_proj consumes cat([hidden_layernorm(h), token_layernorm(e)]), hidden
        # state first (vLLM/SGLang mimo_mtp.py), while Tandem's eh_proj (as DeepSeek-V3's)
        # consumes cat([enorm(e), hnorm(h)]): same map, column halves swapped.
        tensor = torch.cat([tensor[:, hidden:], tensor[:, :hidden]], dim=1)
    mimo = {
        "enorm": "token_layernorm",
        "hnorm": "hidden_layernorm",
        "eh_proj": "input_proj",
        "final_norm": "final_layernorm",
    }[module]
    return f"{prefix}{mimo}.{kind}", tensor


def to_deepseek(name: str, num_hidden: int) -> str:
    _, index, rest = name.split(".", 2)
    prefix = f"model.layers.{num_hidden + int(index)}."
    if rest.startswith("block."):
        return prefix + rest.removeprefix("block.")
    return prefix + rest.replace("final_norm.", "shared_head.norm.")


def write_checkpoint(directory, architecture: str, shards: dict[str, dict]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(architecture), f)
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, file))


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


# ---- checkpoint layouts --------------------------------------------------------------------


def test_rename_mimo_and_deepseek():
    assert rename_mimo("model.mtp_layers.0.token_layernorm.weight") == "layers.0.enorm.weight"
    assert rename_mimo("model.mtp_layers.1.input_proj.weight") == "layers.1.eh_proj.weight"
    assert rename_mimo("model.mtp_layers.0.final_layernorm.weight") == (
        "layers.0.final_norm.weight"
    )
    assert rename_mimo("model.mtp_layers.0.input_layernorm.weight") == (
        "layers.0.block.input_layernorm.weight"
    )
    assert rename_mimo("model.mtp_layers.0.self_attn.q_proj.bias") == (
        "layers.0.block.self_attn.q_proj.bias"
    )
    assert rename_mimo("model.layers.0.input_layernorm.weight") is None
    n = TINY.num_layers
    assert rename_deepseek(f"model.layers.{n}.enorm.weight", n) == "layers.0.enorm.weight"
    assert rename_deepseek(f"model.layers.{n + 1}.eh_proj.weight", n) == ("layers.1.eh_proj.weight")
    assert rename_deepseek(f"model.layers.{n}.shared_head.norm.weight", n) == (
        "layers.0.final_norm.weight"
    )
    assert rename_deepseek(f"model.layers.{n}.mlp.up_proj.weight", n) == (
        "layers.0.block.mlp.up_proj.weight"
    )
    assert rename_deepseek(f"model.layers.{n}.embed_tokens.weight", n) is None
    assert rename_deepseek(f"model.layers.{n}.shared_head.head.weight", n) is None
    assert rename_deepseek(f"model.layers.{n - 1}.mlp.up_proj.weight", n) is None
    assert rename_deepseek("model.norm.weight", n) is None


@pytest.fixture(scope="module")
def mimo_checkpoint(tmp_path_factory):
    """A MiMo-layout directory: Qwen2-shaped target plus one MTP layer (model.mtp_layers.0)."""
    directory = tmp_path_factory.mktemp("mimo")
    arch = ModelArchConfig.from_hf_config(hf_config("MiMoForCausalLM"))
    target, tensors = target_tensors(arch, seed=2)
    reference = random_head(arch, 1, seed=3)
    for name, tensor in reference.export_weights().items():
        mimo_name, mimo_tensor = to_mimo(name, tensor, arch.hidden_size)
        tensors[mimo_name] = mimo_tensor
    write_checkpoint(directory, "MiMoForCausalLM", {"model.safetensors": tensors})
    return str(directory), target, reference


def test_mimo_arch_is_qwen2_shaped():
    arch = ModelArchConfig.from_hf_config(hf_config("MiMoForCausalLM"))
    assert arch.architecture == "MiMoForCausalLM"
    assert arch.attention_bias and not arch.qk_norm
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers, arch.head_dim) == (512, 64, 2, 16)


def test_mimo_checkpoint_loads_head(mimo_checkpoint):
    directory, _, reference = mimo_checkpoint
    files = ModelFiles(directory)
    head = load_mtp_head(None, files, make_rotary(files.arch))
    assert head.num_layers == 1
    assert head.layers[0].block.self_attn.qkv_proj.bias is not None  # Qwen2 biases loaded
    # eh_proj is checked on its own below.
    assert_same_params(head, reference, skip={"layers.0.eh_proj.weight"})


def test_mimo_input_proj_takes_hidden_state_first(mimo_checkpoint):
    """MiMo's input_proj multiplies cat([hidden, embedding]); Tandem's eh_proj multiplies
    cat([embedding, hidden]), so loading must swap the two column halves."""
    directory, _, reference = mimo_checkpoint
    files = ModelFiles(directory)
    head = load_mtp_head(None, files, make_rotary(files.arch))
    loaded = head.layers[0].eh_proj.weight.detach()
    expected = reference.layers[0].eh_proj.weight.detach()
    h = files.arch.hidden_size
    unswapped = torch.equal(loaded, torch.cat([expected[:, h:], expected[:, :h]], dim=1))
    assert torch.equal(loaded, expected), "eh_proj differs from the reference" + (
        " (MiMo input_proj was copied without swapping its [hidden | embedding] column halves)"
        if unswapped
        else ""
    )


def test_mimo_target_still_loads(mimo_checkpoint):
    directory, target, _ = mimo_checkpoint
    model = load_model(ModelFiles(directory), MAX_POSITION, torch.float32, torch.device("cpu"))
    assert_same_params(model, target)


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    """A DeepSeek-V3-layout directory: the MTP layer is model.layers.{n} in a second shard,
    with its own (shared, ignored) embed_tokens and shared_head.head copies."""
    directory = tmp_path_factory.mktemp("deepseek")
    arch = ModelArchConfig.from_hf_config(hf_config("LlamaForCausalLM"))
    target, tensors = target_tensors(arch, seed=4)
    reference = random_head(arch, 1, seed=5)
    n = arch.num_layers
    mtp = {to_deepseek(name, n): t for name, t in reference.export_weights().items()}
    mtp[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    mtp[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"]
    write_checkpoint(
        directory,
        "LlamaForCausalLM",
        {
            "model-00001-of-00002.safetensors": tensors,
            "model-00002-of-00002.safetensors": mtp,
        },
    )
    return str(directory), target, reference


def test_deepseek_checkpoint_loads_head(deepseek_checkpoint):
    directory, _, reference = deepseek_checkpoint
    files = ModelFiles(directory)
    assert not files.arch.attention_bias
    head = load_mtp_head(None, files, make_rotary(files.arch))
    assert head.num_layers == 1
    assert_same_params(head, reference)


def test_deepseek_target_still_loads(deepseek_checkpoint):
    directory, target, _ = deepseek_checkpoint
    model = load_model(ModelFiles(directory), MAX_POSITION, torch.float32, torch.device("cpu"))
    assert_same_params(model, target)


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


# ---- forward -------------------------------------------------------------------------------


BLOCK_SIZE = 4
NUM_BLOCKS = 4


def layer_pass(layer, backend, cache, positions, embeds, hidden, seq_len, block_table):
    slots = torch.tensor(
        [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    )
    metadata = backend.build_metadata(
        [len(positions)], [seq_len], [block_table], slots, BLOCK_SIZE, torch.device("cpu")
    )
    return layer(torch.tensor(positions), embeds, hidden, cache, metadata, backend)


def test_mtp_layer_forward_over_paged_cache():
    files = ModelFiles("dummy:tiny")
    head = load_mtp_head("dummy", files, make_rotary(files.arch)).eval()
    layer = head.layers[0]
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(0)
    T = 6
    embeds = torch.randn(T, TINY.hidden_size, generator=generator)
    hidden = torch.randn(T, TINY.hidden_size, generator=generator)
    table = [2, 0]  # scattered blocks
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, TINY.num_kv_heads, TINY.head_dim)

    with torch.no_grad():
        cache = torch.zeros(shape)
        full = layer_pass(layer, backend, cache, list(range(T)), embeds, hidden, T, table)
        assert full.shape == (T, TINY.hidden_size)
        assert torch.isfinite(full).all()
        assert cache[:, 2].abs().sum() > 0 and cache[:, 0, : T - BLOCK_SIZE].abs().sum() > 0
        assert cache[:, 1].abs().sum() == 0 and cache[:, 3].abs().sum() == 0

        # The same tokens in two chunks (prefill, then a continuation over the cached KV).
        chunked_cache = torch.zeros(shape)
        first = layer_pass(
            layer, backend, chunked_cache, [0, 1, 2, 3], embeds[:4], hidden[:4], 4, table
        )
        second = layer_pass(layer, backend, chunked_cache, [4, 5], embeds[4:], hidden[4:], 6, table)
        torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-5, atol=1e-5)

        # The output depends on both inputs.
        other = layer_pass(
            layer, backend, torch.zeros(shape), list(range(T)), embeds, hidden.flip(0), T, table
        )
        assert not torch.allclose(other, full)
