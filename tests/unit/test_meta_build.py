"""The model built on the meta device and given storage (``LlamaModel.materialize``, what
``load_model`` does to skip nn.Linear's random init) has the eager build's structure: the same
parameter names and shapes on the device, the same rotary tables bit for bit (Llama-3
frequency scaling too), the LM head tied to the embedding when the architecture ties them and
its own matrix when not, and no tensor left on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.models.llama import LlamaModel
from tandem.models.registry import dummy_preset

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("scaling", [None, LLAMA3_ROPE], ids=["rope", "llama3-rope"])
def test_the_materialized_model_is_the_eager_one_without_its_random_values(tied, scaling):
    arch = dataclasses.replace(dummy_preset("tiny"), tie_word_embeddings=tied, rope_scaling=scaling)
    eager = LlamaModel(arch, 256)
    with torch.device("meta"):
        built = LlamaModel(arch, 256)
    assert built.materialize(torch.device("cpu")) is built
    shapes = {n: tuple(p.shape) for n, p in built.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in eager.named_parameters()}
    tensors = list(built.parameters()) + list(built.buffers())
    assert all(t.device == torch.device("cpu") for t in tensors)
    assert torch.equal(built.rotary.cos, eager.rotary.cos)
    assert torch.equal(built.rotary.sin, eager.rotary.sin)
    # Every layer rotates with the tables just computed (one module shared by all).
    assert all(layer.self_attn.rotary.cos is built.rotary.cos for layer in built.layers)
    assert (built.lm_head.weight is built.embed_tokens.weight) == tied
