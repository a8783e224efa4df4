"""Programmatic dependent launch between our kernels: the rule for when a launch takes it,
and on a GPU that has it, a layer's chain of Triton neighbours (norm inside the q/k/v
projection, the rotating attention launched to overlap it, the combination of its key
ranges launched to overlap the attention, the output projection by the Triton GEMM launched
to overlap the combination, then the gated gate-up projection launched to overlap that, the
two GEMMs loading their first weight tile before they wait) captured in a CUDA graph gives,
replay after replay on fresh inputs, what the same chain launched plainly gives: no kernel
reads its input before the kernel before it wrote it."""

from __future__ import annotations

import pytest
import torch

from tandem.layers import dependent_launch


def test_no_dependent_launch_off_a_compiled_gpu():
    x = torch.zeros(4)
    assert not dependent_launch.pdl_supported(x)
    assert dependent_launch.pdl_launch(x, after_triton=True) == (False, False, {})


def _chain(x, residual, w, cache, step, after_triton):
    from tandem.layers.skinny_linear import linear, norm_linear
    from tandem.layers.triton_attention import NewKeys, paged_attention

    qkv, summed = norm_linear(x, w["n1"], 1e-5, w["qkv"], residual=residual)
    q, k, v = qkv.view(x.shape[0], -1, 64).split([9, 3, 3], dim=1)
    attended = paged_attention(
        q,
        *cache,
        step["tables"],
        step["starts"],
        step["seq_lens"],
        4,
        0.125,
        new_keys=NewKeys(k, v, step["cos"], step["sin"], step["slots"]),
        after_triton=after_triton,
    )
    projected = linear(
        attended.reshape(x.shape[0], -1), w["o"], after_triton=after_triton, use_triton=True
    )
    return norm_linear(
        projected, w["n2"], 1e-5, w["gate_up"], residual=summed, gated=True,
        after_triton=after_triton,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a GPU with programmatic dependent launch (compute capability 9.0+)",
)
def test_a_graph_of_dependent_launches_matches_plain_launches():
    from tandem.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    hidden, rows = 576, 4

    def weight(*shape):
        return torch.randn(*shape, device=device, dtype=dtype) / shape[-1] ** 0.5

    w = {
        "n1": 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
        "n2": 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
        "qkv": weight(15 * 64, hidden),
        "o": weight(hidden, 9 * 64),
        "gate_up": weight(2 * 1536, hidden),
    }
    rotary = RotaryEmbedding(64, 4096, 10000.0, None).to(device)
    seq_len = 300
    blocks = -(-seq_len // 16)
    step = {
        "tables": torch.randperm(blocks + 2, device=device)[:blocks].int().unsqueeze(0),
        "starts": torch.tensor([0, rows], device=device, dtype=torch.int32),
        "seq_lens": torch.tensor([seq_len], device=device, dtype=torch.int32),
        "cos": rotary.cos,
        "sin": rotary.sin,
    }
    table = step["tables"][0].tolist()
    positions = range(seq_len - rows, seq_len)
    step["slots"] = torch.tensor([table[p // 16] * 16 + p % 16 for p in positions], device=device)
    cache_shape = (blocks + 2, 16, 3, 64)
    start_cache = [torch.randn(cache_shape, device=device, dtype=dtype) for _ in range(2)]
    inputs = [torch.randn(2, rows, hidden, device=device, dtype=dtype) for _ in range(20)]

    expected = []
    for pair in inputs:  # plain launches, one input at a time, from the same cache
        cache = [c.clone() for c in start_cache]
        expected.append(_chain(pair[0], pair[1], w, cache, step, after_triton=False))

    static = inputs[0].clone()
    cache = [c.clone() for c in start_cache]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(static[0], static[1], w, cache, step, after_triton=True)  # compile, warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static[0], static[1], w, cache, step, after_triton=True)
    for pair, (want, want_sum) in zip(inputs, expected, strict=True):
        static.copy_(pair)
        for c, start in zip(cache, start_cache, strict=True):
            c.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], want_sum)
        assert torch.equal(out[0], want)
