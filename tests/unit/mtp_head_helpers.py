"""The MTP head tests' material: the tiny architecture (the ``dummy:tiny`` preset), random
heads and target models, parameter comparison, and Hugging Face style checkpoint
directories (config.json plus safetensors shards)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tandem.layers.attention import DenseCausalBackend
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import LlamaModel, split_fused_weights
from tandem.models.mtp import MTPHead
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


def write_checkpoint(directory, architecture: str, shards: dict[str, dict]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(architecture), f)
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, file))


def dense_layer(layer, positions: list[int], tokens: list[int], hidden, model) -> torch.Tensor:
    """An MTP layer's output over one sequence of rows at ``positions`` (causal, no cache):
    each row on its ``hidden`` input and the embedding of its token in ``tokens``."""
    device = hidden.device
    return layer(
        torch.tensor(positions, device=device),
        model.embed_tokens(torch.tensor(tokens, device=device)),
        hidden,
        (None, None),
        None,
        DenseCausalBackend(1, len(positions)),
    )


def head_with_features(base: LlamaModel, head: MTPHead, layers, low_scale: float = 0.0):
    """A copy of ``head`` drafting from fused features of the base's ``layers`` (ending with
    its last): as it was (``low_scale`` 0), or with the other layers' blocks of the projection
    random at that scale (seeded), so that they steer the drafts."""
    import copy

    fused = copy.deepcopy(head)
    fused.add_feature_projection(tuple(layers), base.norm.weight)
    if low_scale:
        size = base.arch.hidden_size
        low = fused.feature_proj.weight[:, :-size]
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            low.copy_(low_scale * torch.randn(low.shape, generator=generator).to(low.dtype))
    return fused


def without_features(head: MTPHead, rotary: RotaryEmbedding) -> MTPHead:
    """``head``'s layers as a head that drafts from the target's final hidden state."""
    plain = MTPHead(head.arch, head.num_layers, rotary)
    plain.layers.load_state_dict(head.layers.state_dict())
    return plain
