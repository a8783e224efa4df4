"""The fused Triton kernels against their PyTorch references, fp32 and fp16: in Triton's
interpreter on the CPU, compiled where there is a GPU (bf16 through the engine's tests).
The CPU engine test runs only in the interpreter."""

import pytest
import torch

from tandem.layers import fused, fused_rotary
from tandem.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=generator).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=generator).to(DEVICE, dtype)
    residual = residual if with_residual else None
    got = fused.rms_norm(x, weight, 1e-5, residual, use_triton=True)
    expected = fused.rms_norm_reference(x, weight, 1e-5, residual)
    if not with_residual:
        got, expected = (got,), (expected,)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and g.shape == x.shape
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])


def test_rms_norm_of_a_strided_view():
    x = torch.randn(5, 3, 96, device=DEVICE)[:, 1]  # rows 288 elements apart
    weight = torch.rand(96, device=DEVICE) + 0.5
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-6, use_triton=True),
        fused.rms_norm_reference(x, weight, 1e-6),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_on_the_fused_qkv_view(dtype, head_dim):
    """q and k heads as the model hands them over: a slice of the fused qkv projection."""
    num_heads, num_kv_heads, tokens = 6, 2, 9
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    generator = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(
        DEVICE, dtype
    )
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(tokens, -1, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    cos, sin = rope.cos.to(dtype), rope.sin.to(dtype)
    got = fused_rotary.rotary(qk, positions, cos, sin, use_triton=True)
    torch.testing.assert_close(
        got, fused_rotary.rotary_reference(qk, positions, cos, sin), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_store_kv_rotates_queries_and_fills_only_the_given_slots(dtype, head_dim):
    num_heads, num_kv_heads, tokens, num_blocks, block_size = 6, 2, 9, 5, 4
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None).to(DEVICE)
    generator = torch.Generator().manual_seed(head_dim + 1)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(
        DEVICE, dtype
    )
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], -1)
    qk, v = qk.view(tokens, -1, head_dim), v.view(tokens, -1, head_dim)  # strided views
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens].to(DEVICE)
    cos, sin = rope.cos.to(dtype), rope.sin.to(dtype)
    caches = torch.randn(
        2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator
    ).to(DEVICE, dtype)
    got_k, got_v, want_k, want_v = caches[0, 0], caches[0, 1], caches[1, 0], caches[1, 1]
    want_k.copy_(got_k)
    want_v.copy_(got_v)
    before = got_k.clone()
    q = fused_rotary.rotary_store_kv(
        qk, v, positions, cos, sin, got_k, got_v, slots, num_heads, use_triton=True
    )
    q_ref = fused_rotary.rotary_store_kv_reference(
        qk, v, positions, cos, sin, want_k, want_v, slots, num_heads
    )
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, want_k, **TOLERANCE[dtype])
    assert torch.equal(got_v, want_v)  # values are copied, not computed
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(
        got_k.view(-1, num_kv_heads, head_dim)[untouched],
        before.view(-1, num_kv_heads, head_dim)[untouched],
    )
    assert not torch.equal(got_k, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(dtype):
    generator = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(5, 1536, generator=generator)).to(DEVICE, dtype)
    up = torch.randn(5, 1536, generator=generator).to(DEVICE, dtype)
    torch.testing.assert_close(
        fused.silu_mul(gate, up, use_triton=True),
        fused.silu_mul_reference(gate, up),
        **TOLERANCE[dtype],
    )


def test_silu_mul_reads_the_halves_of_a_fused_projection_in_place():
    """The two halves of one gate-up output are strided views: the kernel takes them as they
    are (3-D, several rows) and gives what the reference gives on contiguous copies."""
    generator = torch.Generator().manual_seed(2)
    gate_up = 3 * torch.randn(2, 3, 2 * 1100, generator=generator).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    got = fused.silu_mul(gate, up, use_triton=True)
    torch.testing.assert_close(
        got,
        fused.silu_mul_reference(gate.contiguous(), up.contiguous()),
        **TOLERANCE[torch.float32],
    )
    assert got.shape == (2, 3, 1100)


def test_fused_gate_up_mlp_matches_the_two_matrices():
    from tandem.models.llama import MLP
    from tandem.models.registry import dummy_preset

    torch.manual_seed(3)
    mlp = MLP(dummy_preset("tiny")).requires_grad_(False)
    x = torch.randn(7, dummy_preset("tiny").hidden_size)
    expected = mlp(x)
    mlp.fuse_gate_up()
    assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj")
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_keeps_the_references_dtype():
    """An fp16 input with an fp32 weight (autocast in training): the product is fp32."""
    x = torch.randn(3, 64, device=DEVICE).half()
    weight = torch.rand(64, device=DEVICE) + 0.5
    got = fused.rms_norm(x, weight, 1e-5, use_triton=True)
    expected = fused.rms_norm_reference(x, weight, 1e-5)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_reference_form_off_cuda_and_under_autograd():
    x = torch.randn(2, 8, requires_grad=True)
    weight = torch.ones(8)
    assert not fused.kernels_apply(x, weight)  # CPU tensors
    out = fused.rms_norm(x, weight, 1e-5)
    out.sum().backward()  # the reference form keeps the graph
    assert x.grad is not None


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU engine runs kernels only interpreted")
def test_engine_with_the_kernels_matches_the_reference_form(monkeypatch):
    """The whole model with every fused op as a kernel (in the interpreter) gives the
    reference form's greedy tokens and logprobs: the kernels are wired in right (the q/k
    view, the residual order)."""
    from tandem import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 8]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)

    def run():
        llm = LLM(model="dummy:tiny", dtype="float32", kv_cache_memory_gb=0.01)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    reference = run()
    calls = []

    def always(*tensors):
        calls.append(len(tensors))
        return not torch.is_grad_enabled()

    # Each module looks the rule up in its own namespace: patch both.
    monkeypatch.setattr(fused, "kernels_apply", always)
    monkeypatch.setattr(fused_rotary, "kernels_apply", always)
    kernels = run()
    assert len(calls) > 10
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(kernels, reference, strict=True):
        assert tokens == ref_tokens
        for got, expected in zip(logprobs, ref_logprobs, strict=True):
            for token, entry in expected.items():
                assert abs(got[token].logprob - entry.logprob) < 1e-5


def test_loaded_models_need_no_grad_so_the_kernels_apply_in_any_grad_mode():
    """The fused kernels stand aside whenever autograd may need a graph; a served model's
    weights must therefore not require grad, or a CUDA graph captured with grad enabled
    would hold the PyTorch forms (it did once)."""
    from tandem.models.loader import ModelFiles, load_model

    model = load_model(ModelFiles("dummy:tiny"), 64, torch.float32, torch.device("cpu"))
    assert not any(p.requires_grad for p in model.parameters())
