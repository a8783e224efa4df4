"""Sampling, seeds and stop conditions through the offline API on the default model."""

from __future__ import annotations

import itertools

import pytest

from tandem import SamplingParams

PROMPTS = [
    "Once upon a time",
    "The three most important things about",
    "def fibonacci(n):",
    "Dear hiring manager,",
    "In 1492,",
    "The recipe calls for",
    "Here is a list of fruits:",
    "Q: What is 12 times 12?\nA:",
]


@pytest.mark.slow
def test_seeded_sampling_same_alone_and_in_batch_of_8(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=20)
    batch = [PROMPTS[0]] + PROMPTS[1:]
    outputs = llm.generate(batch, [params] + [unseeded] * 7)
    assert outputs[0].outputs[0].token_ids == alone
    # The same seed at another batch position gives the same tokens too.
    outputs = llm.generate(PROMPTS[1:4] + [PROMPTS[0]], [unseeded] * 3 + [params])
    assert outputs[3].outputs[0].token_ids == alone


@pytest.mark.slow
def test_different_seeds_give_different_samples(llm):
    outputs = llm.generate(
        [PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(4)]
    )
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=16))
    top1 = llm.generate(PROMPTS[2], SamplingParams(temperature=1.5, top_k=1, max_tokens=16))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_sampled_tokens_stay_inside_top_k(llm):
    params = SamplingParams(temperature=2.0, top_k=3, max_tokens=12, logprobs=3, seed=7)
    completion = llm.generate(PROMPTS[3], params)[0].outputs[0]
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token].rank <= 3


def test_sampled_tokens_stay_inside_min_p(llm):
    params = SamplingParams(temperature=1.5, min_p=0.3, max_tokens=12, logprobs=1, seed=3)
    completion = llm.generate(PROMPTS[4], params)[0].outputs[0]
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        best = max(lp.logprob for lp in position.values())
        # min_p keeps tokens with p >= 0.3 * p_max of the tempered distribution; at
        # temperature 1.5 that bounds the raw logprob gap by 1.5 * ln(1 / 0.3).
        assert best - position[token].logprob <= 1.5 * 1.2040 + 1e-4


def test_invariant_logprobs_hold_top_n_sorted_and_the_sampled_token(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, logprobs=5, seed=11)
    completion = llm.generate(PROMPTS[5], params)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in position
        top = sorted((lp for t, lp in position.items() if lp.rank <= 5), key=lambda x: x.rank)
        assert [lp.rank for lp in top] == [1, 2, 3, 4, 5]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(top))
        assert position[token].rank >= 1 and position[token].decoded_token is not None


def test_max_tokens_gives_length(llm):
    completion = llm.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert len(completion.token_ids) == 7 and completion.finish_reason == "length"


def test_stop_string_spanning_tokens_is_cut_from_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate(PROMPTS[7], params)[0].outputs[0]
    # Take a stop string that straddles the boundary of the 2nd and 3rd generated tokens.
    tokenizer = llm.tokenizer
    text_two = tokenizer.decode(full.token_ids[:2])
    text_three = tokenizer.decode(full.token_ids[:3])
    assert len(text_three) > len(text_two) >= 1
    stop = text_two[-1:] + text_three[len(text_two) : len(text_two) + 1]
    expected = full.text[: full.text.index(stop)]
    stopped = llm.generate(PROMPTS[7], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    completion = stopped[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == expected
    assert len(completion.token_ids) <= 3


def test_eos_stops_and_ignore_eos_and_min_tokens(llm):
    prompt = {
        "prompt_token_ids": llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say only the word yes."}]
        )
    }
    natural = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert natural.finish_reason == "stop"
    assert natural.token_ids[-1] in llm.tokenizer.end_token_ids
    assert natural.stop_reason == natural.token_ids[-1]
    n = len(natural.token_ids)
    ignored = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True)
    )[0].outputs[0]
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 2))[
        0
    ].outputs[0]
    assert len(held.token_ids) >= n + 2
    assert not any(t in llm.tokenizer.end_token_ids for t in held.token_ids[: n + 1])


def test_stop_token_ids_end_the_request(llm):
    params = SamplingParams(temperature=0, max_tokens=30)
    full = llm.generate(PROMPTS[0], params)[0].outputs[0]
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    stopped = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])
    )[0].outputs[0]
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token


def test_chat_and_metrics(llm):
    before = llm.get_metrics()
    outputs = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
    )
    assert "Paris" in outputs[0].outputs[0].text
    after = llm.get_metrics()
    assert after["num_requests_finished"] == before["num_requests_finished"] + 1
    assert after["num_generation_tokens"] > before["num_generation_tokens"]
