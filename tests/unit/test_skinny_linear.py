"""The norm-inside-the-projection kernels against their PyTorch references, in Triton's
interpreter on the CPU (fp32 and fp16; bf16 on the GPU), and a whole engine with them
forced in (plain and MTP)."""

import pytest
import torch

from tandem.layers import argmax, fused, skinny_linear
from tandem.models import llama

pytestmark = pytest.mark.skipif(skinny_linear.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _tensors(rows, k_in, n_out, dtype, seed):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(DEVICE, dtype)

    return {
        "x": draw(rows, k_in),
        "residual": draw(rows, k_in),
        "norm_weight": (1 + 0.1 * torch.randn(k_in, generator=generator)).to(DEVICE, dtype),
        "norm_weight2": (1 + 0.1 * torch.randn(k_in, generator=generator)).to(DEVICE, dtype),
        "weight": draw(n_out, k_in, scale=k_in**-0.5),
        "weight2": draw(n_out, 2 * k_in, scale=(2 * k_in) ** -0.5),
        "bias": draw(n_out),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_linear(dtype, rows, with_residual, with_bias):
    # 300 input columns: not a multiple of the kernel's K tile; 40 outputs: not of its N tile.
    t = _tensors(rows, 300, 40, dtype, seed=rows)
    residual = t["residual"] if with_residual else None
    bias = t["bias"] if with_bias else None
    args = (t["x"], t["norm_weight"], 1e-5, t["weight"], bias, residual)
    got = skinny_linear.norm_linear(*args, use_triton=True)
    expected = skinny_linear.norm_linear_reference(*args)
    if not with_residual:
        got, expected = (got,), (expected,)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])
    if with_residual:  # the residual stream's new value is the sum, rounded, exactly
        assert torch.equal(got[1], t["x"] + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n_out", [80, 4200])  # gate-up matrices of both tilings
def test_norm_linear_gated(dtype, rows, with_residual, n_out):
    """The gate-up projection with SiLU-and-multiply in its epilogue: what the fused kernels
    give one after the other (the projection, then ``fused.silu_mul``'s reference)."""
    t = _tensors(rows, 300, n_out, dtype, seed=50 + rows)
    residual = t["residual"] if with_residual else None
    args = (t["x"], t["norm_weight"], 1e-5, t["weight"])
    got = skinny_linear.norm_linear(*args, residual=residual, gated=True, use_triton=True)
    projected = skinny_linear.norm_linear_reference(*args, residual=residual)
    if with_residual:
        assert torch.equal(got[1], projected[1])
        got, projected = got[0], projected[0]
    gate, up = projected.chunk(2, dim=-1)
    expected = fused.silu_mul_reference(gate, up)
    assert got.shape == (rows, n_out // 2)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    reference_form = skinny_linear.norm_linear(*args, gated=True, use_triton=False)
    torch.testing.assert_close(
        reference_form, skinny_linear.gated_reference(skinny_linear.norm_linear_reference(*args))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n_out", [24, 2100])  # both tilings
def test_two_norm_linear(dtype, rows, n_out):
    # 200 columns a half: the K tile (256) straddles the two halves.
    t = _tensors(rows, 200, n_out, dtype, seed=100 + rows)
    wide = torch.cat([t["residual"], t["x"]], dim=-1)  # the hidden state: its last columns
    args = (t["residual"], wide[:, 200:], t["norm_weight"], t["norm_weight2"], 1e-5, t["weight2"])
    got = skinny_linear.two_norm_linear(*args, use_triton=True)
    expected = skinny_linear.two_norm_linear_reference(*args)
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    unfused = skinny_linear.two_norm_linear(*args, use_triton=False)
    torch.testing.assert_close(unfused, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_without_a_norm(dtype, rows, with_bias):
    """The plain GEMM (the output projection's candidate) is ``F.linear``; ``after_triton``
    changes only how it launches (nothing off the GPU), never what it computes."""
    t = _tensors(rows, 300, 40, dtype, seed=rows + 11)
    bias = t["bias"] if with_bias else None
    expected = torch.nn.functional.linear(t["x"], t["weight"], bias)
    for after_triton in (False, True):
        got = skinny_linear.linear(t["x"], t["weight"], bias, after_triton, use_triton=True)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    # Batched leading dimensions keep their shape; a CPU tensor takes F.linear itself.
    batched = skinny_linear.linear(t["x"].view(1, rows, 300), t["weight"], use_triton=True)
    assert batched.shape == (1, rows, 40)
    cpu = torch.randn(2, 8)
    assert torch.equal(skinny_linear.linear(cpu, torch.eye(8)), cpu @ torch.eye(8).T)


def test_norm_linear_after_triton_computes_the_same():
    t = _tensors(4, 96, 64, torch.float32, seed=3)
    args = (t["x"], t["norm_weight"], 1e-5, t["weight"])
    plain = skinny_linear.norm_linear(*args, residual=t["residual"], gated=True, use_triton=True)
    waiting = skinny_linear.norm_linear(
        *args, residual=t["residual"], gated=True, use_triton=True, after_triton=True
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, waiting, strict=True))


def test_each_half_takes_its_own_norm():
    """The two halves' scales and weights are not swapped or shared: scaling one input by
    100 leaves the RMSNorm of each half (and so the output) as it was."""
    t = _tensors(3, 64, 32, torch.float32, seed=5)
    args = (t["norm_weight"], t["norm_weight2"], 1e-6, t["weight2"])
    base = skinny_linear.two_norm_linear(t["x"], t["residual"], *args, use_triton=True)
    scaled = skinny_linear.two_norm_linear(100 * t["x"], t["residual"], *args, use_triton=True)
    torch.testing.assert_close(scaled, base, rtol=1e-4, atol=1e-4)
    swapped = skinny_linear.two_norm_linear(
        t["x"], t["residual"], t["norm_weight2"], t["norm_weight"], 1e-6, t["weight2"],
        use_triton=True,
    )  # fmt: skip
    assert not torch.allclose(swapped, base, rtol=1e-3, atol=1e-3)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Plain decoding runs one row where the verification runs four: a row's output must be
    the same bits whatever the rows beside it hold, or greedy MTP could part from plain
    decoding. Each row is checked in place, beside other rows and beside zeros (the
    masked rows of a smaller batch). Not across row indices: under the interpreter
    ``tl.dot`` is numpy's matmul, whose BLAS may round a row differently at another index
    (on an AMD EPYC with scipy-openblas 0.3.31 it did for every row but the first)."""
    t = _tensors(9, 80, 48, torch.float32, seed=7)
    args = (t["norm_weight"], 1e-5, t["weight"])
    together = skinny_linear.norm_linear(t["x"], *args, use_triton=True)
    others = _tensors(9, 80, 48, torch.float32, seed=8)["x"]
    for row in range(9):
        beside_others = others.clone()
        beside_others[row] = t["x"][row]
        beside_zeros = torch.zeros_like(t["x"][: row + 1])
        beside_zeros[row] = t["x"][row]
        for x in (beside_others, beside_zeros):
            out = skinny_linear.norm_linear(x, *args, use_triton=True)
            assert torch.equal(out[row], together[row])
    # The first row, alone, is the row index plain decoding uses.
    alone = skinny_linear.norm_linear(t["x"][:1], *args, use_triton=True)
    assert torch.equal(alone[0], together[0])


def test_the_rule_for_when_the_kernels_apply():
    x = torch.randn(4, 8)
    weight = torch.randn(8, 8)
    assert not skinny_linear.norm_linear_applies(x, weight)  # CPU tensors
    out = skinny_linear.norm_linear(x, torch.ones(8), 1e-5, weight)  # the reference form
    torch.testing.assert_close(
        out, skinny_linear.norm_linear_reference(x, torch.ones(8), 1e-5, weight)
    )
    if torch.cuda.is_available():
        few = torch.randn(16, 576, device="cuda")
        assert skinny_linear.norm_linear_applies(few, few[0])
        assert not skinny_linear.norm_linear_applies(torch.randn(17, 576, device="cuda"))
        assert not skinny_linear.norm_linear_applies(torch.randn(4, 4096, device="cuda"))


def test_misfitting_inputs_are_refused():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear.norm_linear(x, torch.ones(10), 1e-5, torch.randn(4, 12), use_triton=True)
    with pytest.raises(ValueError, match="no bias"):
        skinny_linear.norm_linear(
            x, torch.ones(10), 1e-5, torch.randn(4, 10), torch.ones(4), gated=True
        )
    with pytest.raises(ValueError, match="even number"):
        skinny_linear.norm_linear(
            x, torch.ones(10), 1e-5, torch.randn(5, 10), gated=True, use_triton=True
        )
    with pytest.raises(ValueError, match="differ in shape"):
        skinny_linear.two_norm_linear(
            x, torch.randn(3, 10), torch.ones(10), torch.ones(10), 1e-5, torch.randn(4, 20)
        )


@pytest.mark.slow  # whole engines in Triton's interpreter
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernels are the default")
@pytest.mark.parametrize(
    "engine",
    [{}, {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"}],
    ids=["plain", "mtp"],
)
def test_engine_with_norms_in_projections_matches_the_reference_form(monkeypatch, engine):
    """The whole model with the norms inside the projections (forced in the interpreter,
    with gate and up fused as on the GPU) gives the unfused chain's greedy tokens and
    logprobs: the wiring is right (the residual order, the layer's norms, SiLU-and-multiply
    in the gate-up epilogue, the MTP head's two norms, the head's final norm with its
    residual; the greedy tokens by ``argmax.argmax_rows``'s kernel)."""
    from tandem import LLM, SamplingParams
    from tandem.worker import model_runner

    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 8]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)

    def run():
        llm = LLM(model="dummy:tiny", dtype="float32", kv_cache_memory_gb=0.01, **engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    reference = run()
    launches = []

    def counted(*args, **kwargs):
        launches.append((args[0], kwargs.get("gated", False)))  # (prologue, gated)
        return launch(*args, **kwargs)

    load_model, load_mtp_head = model_runner.load_model, model_runner.load_mtp_head

    def fused_model(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.fuse_gate_up()
        return model

    def fused_head(*args, **kwargs):
        head = load_mtp_head(*args, **kwargs)
        head.fuse_gate_up()
        return head

    launch = skinny_linear._launch
    monkeypatch.setattr(skinny_linear, "_launch", counted)
    monkeypatch.setattr(skinny_linear, "kernels_apply", lambda *t: not torch.is_grad_enabled())
    monkeypatch.setattr(fused, "kernels_apply", lambda *t: not torch.is_grad_enabled())
    monkeypatch.setattr(argmax, "kernels_apply", lambda *t: not torch.is_grad_enabled())
    monkeypatch.setattr(model_runner, "load_model", fused_model)
    monkeypatch.setattr(model_runner, "load_mtp_head", fused_head)
    # The output projection by the Triton GEMM too, as after the Triton attention backend.
    monkeypatch.setattr(
        llama.Attention, "projects_after_triton", lambda self, backend: True, raising=True
    )
    kernels = run()
    kinds = set(launches)
    # The first layer's norm (no residual yet), the later ones', the gated gate-up, the
    # output projection.
    expected_kinds = {
        (skinny_linear._NORM, False),
        (skinny_linear._NORM_RESIDUAL, False),
        (skinny_linear._NORM_RESIDUAL, True),
        (skinny_linear._PLAIN, False),
    }
    if engine:
        expected_kinds.add((skinny_linear._TWO_NORMS, False))
    assert kinds == expected_kinds
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(kernels, reference, strict=True):
        assert tokens == ref_tokens
        for got, expected in zip(logprobs, ref_logprobs, strict=True):
            for token, entry in expected.items():
                assert abs(got[token].logprob - entry.logprob) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_weight_prefetch_computes_the_same_bits(monkeypatch, dtype):
    """With the weight's first tile loaded before the PDL wait (the first K tile's product
    peeled off the loop, in the same order), every form gives the same bits as without:
    plain, with the norm and residual, gated, two norms; K one tile (96) and three (600)."""
    from functools import partial

    launch = skinny_linear._launch

    def outputs():
        out = []
        for k_in in (96, 600):
            t = _tensors(4, k_in, 64, dtype, seed=k_in)
            norm = (t["x"], t["norm_weight"], 1e-5, t["weight"])
            out.append(skinny_linear.linear(t["x"], t["weight"], t["bias"], use_triton=True))
            out += skinny_linear.norm_linear(*norm, residual=t["residual"], use_triton=True)
            out.append(skinny_linear.norm_linear(*norm, use_triton=True, gated=True))
            out.append(
                skinny_linear.two_norm_linear(
                    t["x"], t["residual"], t["norm_weight"], t["norm_weight2"], 1e-5,
                    t["weight2"], use_triton=True,
                )
            )  # fmt: skip
        return out

    plain = outputs()
    monkeypatch.setattr(skinny_linear, "_launch", partial(launch, prefetch=True))
    prefetched = outputs()
    assert all(torch.equal(a, b) for a, b in zip(plain, prefetched, strict=True))


def test_the_output_projection_takes_the_triton_gemm_only_after_triton_attention():
    """The rule: a plain linear layer no wider than the kernel takes, after the Triton
    backend (whose kernels wrote its input); never a tensor-parallel shard, never after the
    torch backend."""
    from dataclasses import replace

    from tandem.layers.attention import TorchAttentionBackend
    from tandem.layers.rotary import RotaryEmbedding
    from tandem.layers.triton_attention import TritonAttentionBackend
    from tandem.models.registry import dummy_preset

    arch = dummy_preset("tiny")
    rotary = RotaryEmbedding(arch.head_dim, 64, arch.rope_theta, None)
    attention = llama.Attention(arch, rotary)
    assert attention.projects_after_triton(TritonAttentionBackend())
    assert not attention.projects_after_triton(TorchAttentionBackend())

    class Shard(torch.nn.Linear):  # a tensor-parallel layer's stand-in
        pass

    attention.o_proj = Shard(attention.q_size, arch.hidden_size, bias=False)
    assert not attention.projects_after_triton(TritonAttentionBackend())
    wide = llama.Attention(replace(arch, num_heads=32, head_dim=64, num_kv_heads=8), rotary)
    assert wide.q_size > skinny_linear.MAX_WIDTH
    assert not wide.projects_after_triton(TritonAttentionBackend())
