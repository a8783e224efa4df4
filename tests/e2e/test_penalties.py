"""Logit bias and the presence, frequency and repetition penalties, greedy, fp32 on the CPU:
every mode (plain, overlap, MTP k = 3 with the shipped head, MTP with overlap) gives the
tokens of a reference greedy loop over Hugging Face transformers' forward with vLLM's
semantics applied to its logits, for a batch mixing the settings with an unadjusted
request; logprobs stay the raw ones. (PD: tests/e2e/test_pd_core.py's penalized case.)"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench

pytestmark = pytest.mark.slow  # four engines and a transformers reference over 6 prompts

MAX_TOKENS = 24
TIE = 1e-4
MTP = {"speculative": "mtp", "num_speculative_tokens": 3}
MODES = {
    "plain": {"overlap": False},
    "overlap": {"overlap": True},
    "mtp": {**MTP, "overlap": False},
    "mtp+overlap": {**MTP, "overlap": True},
}
# Per prompt (cycled); "ban_first" is replaced by a bias of -100 on the token the
# unadjusted reference starts with.
SETTINGS = [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"logit_bias": "ban_first"},
    {},
    {"frequency_penalty": -0.3},
    {"repetition_penalty": 1.1, "presence_penalty": 0.3, "logit_bias": {13: -2.0, 30: 1.5}},
]


def _adjust(logits: torch.Tensor, settings: dict, prompt: list[int], output: list[int]):
    """vLLM's order: bias, repetition over prompt and output, frequency and presence over
    the output."""
    x = logits.clone()
    for token, bias in (settings.get("logit_bias") or {}).items():
        x[token] += bias
    penalty = settings.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    for token, n in Counter(output).items():
        x[token] -= settings.get("frequency_penalty", 0.0) * n
        x[token] -= settings.get("presence_penalty", 0.0)
    return x


@torch.inference_mode()
def _reference(model, prompt: list[int], settings: dict, eos: set[int]) -> tuple[list, list]:
    """Greedy tokens of the adjusted logits, and per step the gap between the two best."""
    tokens, gaps, past = [], [], None
    ids = torch.tensor([prompt])
    for _ in range(MAX_TOKENS):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        adjusted = _adjust(out.logits[0, -1].float(), settings, prompt, tokens)
        top = adjusted.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        if tokens[-1] in eos:
            break
        ids = torch.tensor([[tokens[-1]]])
    return tokens, gaps


@pytest.fixture(scope="module")
def cases(offline, hf_default_model):
    tokenizer = offline.tokenizer
    questions = [q["turns"][0] for q in load_mtbench()[3::7]][:6]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    eos = set(tokenizer.end_token_ids)
    hf = hf_default_model
    settings = []
    for i, prompt in enumerate(prompts):
        chosen = dict(SETTINGS[i % len(SETTINGS)])
        if chosen.get("logit_bias") == "ban_first":
            first = _reference(hf, prompt, {}, eos)[0][0]
            chosen["logit_bias"] = {first: -100.0}
        settings.append(chosen)
    references = [_reference(hf, p, s, eos) for p, s in zip(prompts, settings, strict=True)]
    return prompts, settings, references


@pytest.mark.parametrize("mode", list(MODES))
def test_adjusted_greedy_matches_the_reference_in_every_mode(make_llm, cases, mode):
    prompts, settings, references = cases
    llm = make_llm(**MODES[mode])
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, **s) for s in settings
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = 0
    for output, (want, gaps), s in zip(outputs, references, settings, strict=True):
        got = list(output.outputs[0].token_ids)
        differ = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
        if differ is None:
            assert got == want, (s, got, want)
        else:  # only at a numerical tie of the adjusted logits
            assert gaps[differ] < TIE, (s, differ, got, want)
            ties += 1
    assert ties <= 1
    # Logprobs are the raw ones: the banned first token is still the most likely there.
    banned = next(i for i, s in enumerate(settings) if len(s.get("logit_bias") or {}) == 1)
    (token,) = settings[banned]["logit_bias"]
    first = outputs[banned].outputs[0].logprobs[0]
    assert token in first and first[token].rank == 1
    assert outputs[banned].outputs[0].token_ids[0] != token
    if "speculative" in MODES[mode]:  # a penalized request alone verifies drafts too
        before = llm.get_metrics()["spec_decode_num_drafts"]
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
        assert llm.get_metrics()["spec_decode_num_drafts"] > before
    elif MODES[mode]["overlap"]:  # a penalized row waits for its last token's read
        assert llm.engine.pipeline.num_read_first > 0
