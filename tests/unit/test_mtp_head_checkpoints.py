"""MTP draft head in target checkpoints: the MiMo and DeepSeek-V3 layouts (MTP layers
stored beside the target's weights, under their own names), each loading both the head and
the target unchanged. Tiny shapes (the ``dummy:tiny`` preset), CPU."""

from __future__ import annotations

import pytest
import torch
from mtp_head_helpers import (
    MAX_POSITION,
    TINY,
    assert_same_params,
    hf_config,
    make_rotary,
    random_head,
    target_tensors,
    write_checkpoint,
)

from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head, rename_deepseek, rename_mimo
from tandem.models.registry import ModelArchConfig


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
