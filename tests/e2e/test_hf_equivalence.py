"""DESIGN.md invariant 1 (lossless): greedy tokens equal Hugging Face transformers'
``generate()`` on the same weights (fp32, CPU), and every logprob is within 1e-4 of HF's
log_softmax. The one allowed difference is a numerical tie: at the first position where the
two differ, HF's two best logprobs are within 1e-4; the comparison stops there."""

from __future__ import annotations

import pytest

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.bench.hf_reference import hf_greedy_generate, tie_rule_mismatches

pytestmark = pytest.mark.slow  # HF transformers' greedy references for 33 prompts, then ours

MAX_NEW_TOKENS = 24
TOLERANCE = 1e-4
SHARED_SYSTEM_PROMPT = (
    "You are Tandem's test assistant. Answer carefully and concisely, show your reasoning "
    "step by step when a question needs it, prefer plain words over jargon, and when you write "
    "code use Python with short comments. Never invent facts; say when you are unsure. "
    "Keep every answer under two hundred words unless asked for more."
)
CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what this code does: `print(sum(x * x for x in range(10)))`",
    "Write a SQL query that returns the ten most recent orders from a table named orders.",
    "Fix the bug: def add(a, b): return a - b",
]


def _chat_prompts(tokenizer, system: str | None = None) -> list[list[int]]:
    questions = [q["turns"][0] for q in load_mtbench()[::7]][:12] + CODE_PROMPTS
    prompts = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        prompts.append(tokenizer.apply_chat_template(messages))
    return prompts


def _long_prompt(tokenizer) -> list[int]:
    text = " ".join(q["turns"][0] for q in load_mtbench()[:12])
    messages = [{"role": "user", "content": "Summarize these questions in one line: " + text}]
    return tokenizer.apply_chat_template(messages)


@pytest.fixture(scope="module")
def reference(hf_default_model, llm_cache):
    """Prompts and HF's greedy results for them, computed once for the module."""
    from tandem import LLM

    if () not in llm_cache:
        llm_cache[()] = LLM()
    llm = llm_cache[()]
    tokenizer = llm.tokenizer
    prompts = {
        "chat": _chat_prompts(tokenizer),
        "shared_system": _chat_prompts(tokenizer, SHARED_SYSTEM_PROMPT),
        "long": [_long_prompt(tokenizer)],
    }
    eos = sorted(tokenizer.end_token_ids)
    results = {
        name: hf_greedy_generate(hf_default_model, ids, MAX_NEW_TOKENS, eos)
        for name, ids in prompts.items()
    }
    return prompts, results


def assert_matches_hf(outputs, references) -> int:
    """Assert the tie rule holds for every output; returns how many stopped at a tie."""
    problems, ties = tie_rule_mismatches(outputs, references, TOLERANCE)
    assert not problems, problems
    return ties


def _greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)


def _run(llm, prompt_ids):
    return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], _greedy())


def test_invariant_lossless_greedy_batch_matches_hf(make_llm, reference):
    prompts, results = reference
    assert len(prompts["chat"]) >= 16
    llm = make_llm()
    outputs = _run(llm, prompts["chat"])
    ties = assert_matches_hf(outputs, results["chat"])
    assert ties <= 2, f"{ties} ties out of {len(outputs)} prompts is not plausible"


def test_greedy_matches_hf_under_preemption(make_llm, reference):
    prompts, results = reference
    llm = make_llm(num_kv_blocks=48, max_num_seqs=16)
    before = llm.get_metrics()["num_preemptions"]
    outputs = _run(llm, prompts["chat"])
    assert llm.get_metrics()["num_preemptions"] > before, "the small KV cache forced no preemption"
    assert_matches_hf(outputs, results["chat"])


def test_greedy_matches_hf_with_chunked_prefill(make_llm, reference):
    prompts, results = reference
    long_prompt = prompts["long"][0]
    llm = make_llm(max_num_batched_tokens=64)
    assert len(long_prompt) > 4 * 64, "the long prompt must span several chunks"
    outputs = _run(llm, prompts["long"] + prompts["chat"][:4])
    assert_matches_hf(outputs, results["long"] + results["chat"][:4])


def test_greedy_matches_hf_with_prefix_cache_hits(make_llm, reference):
    prompts, results = reference
    llm = make_llm()
    llm.reset_prefix_cache()
    hits_before = llm.get_metrics()["prefix_cache_hits"]
    first = _run(llm, prompts["shared_system"])
    second = _run(llm, prompts["shared_system"])
    assert llm.get_metrics()["prefix_cache_hits"] - hits_before >= 16 * 64
    assert_matches_hf(first, results["shared_system"])
    assert_matches_hf(second, results["shared_system"])


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_in_full(make_llm):
    """``LLM.reset_prefix_cache``: a prompt seen before hits the cache, and after a reset
    the same prompt finds nothing cached (what `bench decode`'s steady rows rely on)."""
    from tandem import SamplingParams

    llm = make_llm()
    prompt = [{"prompt_token_ids": list(range(1, 70))}]  # four full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)

    def hits_of_one_more_run():
        before = llm.get_metrics()["prefix_cache_hits"]
        llm.generate(prompt, params, use_tqdm=False)
        return llm.get_metrics()["prefix_cache_hits"] - before

    assert hits_of_one_more_run() == 64
    llm.reset_prefix_cache()
    assert hits_of_one_more_run() == 0
