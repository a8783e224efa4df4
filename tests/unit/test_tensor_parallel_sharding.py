"""Tensor-parallel sharding without a process group: which rows and columns a rank keeps,
the per-rank shapes the KV cache is sized from, and the clear errors for models that do not
split, a missing process group and the modes that do not support it yet."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem import LLM
from tandem.cli import main
from tandem.config import DisaggConfig, EngineConfig, ParallelConfig
from tandem.models.llama import LlamaModel
from tandem.models.mtp import MTPHead
from tandem.models.registry import dummy_preset
from tandem.models.tensor_parallel import shard_model, shard_mtp_head

TINY = dummy_preset("tiny")  # 4 query heads, 2 KV heads, head_dim 16, MLP 128, vocab 512


def _model(arch=TINY) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(arch, 64).requires_grad_(False)


def test_kv_heads_that_do_not_divide_raise_a_clear_error():
    with pytest.raises(ValueError, match=r"'dummy:tiny' has 2 KV heads.*tensor_parallel_size 4"):
        LLM(model="dummy:tiny", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        shard_model(_model(), 0, 4)


def test_tensor_parallel_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        LLM(model="dummy:tiny", tensor_parallel_size=2)


def test_a_rank_keeps_its_heads_mlp_rows_and_vocabulary_rows():
    model = _model()
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    qkv, o_proj = attn.qkv_proj.weight.clone(), attn.o_proj.weight.clone()
    gate, down = mlp.gate_proj.weight.clone(), mlp.down_proj.weight.clone()
    embed, lm_head = model.embed_tokens.weight.clone(), model.lm_head.weight.clone()
    shard_model(model, 1, 2)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    # Rank 1 of 2: query heads 2 and 3 (rows 32:64), KV head 1 of k (64+16:96) and v (96+16:).
    expected_qkv = torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    assert torch.equal(attn.o_proj.linear.weight, o_proj[:, 32:64])
    assert (attn.num_heads, attn.num_kv_heads, attn.q_size, attn.kv_size) == (2, 1, 32, 16)
    assert torch.equal(mlp.gate_proj.weight, gate[64:128])
    assert torch.equal(mlp.down_proj.linear.weight, down[:, 64:128])
    assert torch.equal(model.embed_tokens.weight, embed[256:512])
    assert torch.equal(model.lm_head.weight, lm_head[256:512])
    assert (model.arch.num_heads, model.arch.num_kv_heads, model.arch.vocab_size) == (2, 1, 512)
    assert not any(p.requires_grad for p in model.parameters())


def test_tied_embeddings_stay_tied_and_pad_the_vocabulary():
    model = _model(replace(TINY, vocab_size=511, tie_word_embeddings=True))
    embed = model.embed_tokens.weight.clone()
    shard_model(model, 1, 2)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight[:255], embed[256:])
    assert not model.embed_tokens.weight[255].any()  # the padding row


def test_mtp_head_shards_its_blocks_and_replicates_the_rest():
    head = MTPHead(TINY, 1, _model().rotary)
    eh_proj = head.layers[0].eh_proj.weight.clone()
    shard_mtp_head(head, 0, 2)
    block = head.layers[0].block
    assert block.self_attn.qkv_proj.weight.shape == (64, 64)
    assert block.mlp.gate_proj.weight.shape == (64, 64)
    assert torch.equal(head.layers[0].eh_proj.weight, eh_proj)
    assert head.arch.num_kv_heads == 1


def test_parallel_config_is_validated():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="rank"):
        ParallelConfig(2, rank=2)
    with pytest.raises(ValueError, match="not supported yet"):
        EngineConfig(parallel=ParallelConfig(2), disagg=DisaggConfig(role="prefill"))


def test_serve_refuses_one_gpu_for_several_ranks(capsys):
    """`tandem serve` starts the ranks itself (tests/e2e/test_tensor_parallel_serve.py); it
    puts rank r on cuda:r, so a device index cannot go with N > 1."""
    argv = ["serve", "dummy:tiny", "--device", "cuda:1", "--tensor-parallel-size", "2"]
    assert main(argv) == 2
    assert "cuda:r" in capsys.readouterr().err
