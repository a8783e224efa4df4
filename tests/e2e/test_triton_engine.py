"""The whole engine with the Triton attention backend gives the torch backend's output:
greedy tokens and logprobs over a batch mixing prefills, decode rows and (with MTP) the
verification rows of several drafts. Without a GPU the kernel runs in Triton's interpreter,
so the model is the tiny dummy one."""

from __future__ import annotations

import importlib

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow  # whole engines with the Triton kernels in Triton's interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def interpreter():
    """Triton's interpreter on while these tests run (no GPU here)."""
    with pytest.MonkeyPatch.context() as patch:
        if DEVICE == "cpu":
            patch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        importlib.import_module("tandem.layers.triton_attention")
        yield


def _run(backend: str, **engine) -> list:
    llm = LLM(
        model="dummy:tiny",
        device=DEVICE,
        dtype="float32",
        attention_backend=backend,
        max_num_batched_tokens=48,
        **engine,
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)]}
        for i in range(6)
    ]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False
    )
    llm.engine.shutdown()
    return [
        (
            o.outputs[0].token_ids,
            [
                {t: round(lp.logprob, 5) for t, lp in entry.items()}
                for entry in o.outputs[0].logprobs
            ],
        )
        for o in outputs
    ]


@pytest.mark.parametrize(
    "engine",
    [{}, {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"}],
    ids=["plain", "mtp"],
)
def test_triton_backend_matches_torch_backend(interpreter, engine):
    expected = _run("torch", **engine)
    got = _run("triton", **engine)
    _assert_same_outputs(got, expected)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the one launch is the default")
@pytest.mark.parametrize(
    "engine",
    [{}, {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"}],
    ids=["plain", "mtp"],
)
def test_the_rotating_launch_in_the_engine_matches_torch_backend(interpreter, engine):
    """The attention launch that rotates and stores the step's keys itself, forced on the
    CPU (in the interpreter) where the GPU takes it: decode and verification steps through
    it give the torch backend's tokens and logprobs. It rotates each row at the attention's
    own position (``seq_lens - query_len + j``), not the layers' ``positions``: this checks
    that the two agree on every step the engine runs, the MTP head's included."""
    triton_attention = importlib.import_module("tandem.layers.triton_attention")
    launches = []
    paged_attention = triton_attention.paged_attention

    def counted(*args, **kwargs):
        launches.append(kwargs.get("new_keys") is not None)
        return paged_attention(*args, **kwargs)

    expected = _run("torch", **engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "kernels_apply", lambda *t: not torch.is_grad_enabled())
        patch.setattr(triton_attention, "paged_attention", counted)
        got = _run("triton", **engine)
    assert any(launches) and not all(launches)  # decode steps rotated, prompt steps not
    _assert_same_outputs(got, expected)


def _assert_same_outputs(got, expected):
    """The same greedy tokens, and each position's top logprobs within 2e-5."""
    for (got_tokens, got_logprobs), (tokens, logprobs) in zip(got, expected, strict=True):
        assert got_tokens == tokens
        for got_entry, entry in zip(got_logprobs, logprobs, strict=True):
            assert got_entry.keys() == entry.keys()
            for token, value in entry.items():
                assert abs(got_entry[token] - value) <= 2e-5
