"""Completions the way evaluation harnesses call them, through the official ``openai``
client: ``echo`` with and without logprobs (the prompt's logprobs equal the offline API's
prompt logprobs), ``max_tokens: 0`` to score a prompt, several prompts in one request
(choices by index, whole and streamed), the default ``max_tokens`` of 16, and vLLM's
``prompt_logprobs`` field on both endpoints; ``n`` samples per prompt (the prompt
prefilled once: the prefix cache's counters; seeded samples reproducible; usage counts a
prompt once)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import (
    AUTH,
    MODEL,
    PROMPT,
    SHORT_ANSWER_CHAT,
    greedy,
    greedy_chat,
    wait_until_idle,
)

from tandem import SamplingParams

pytestmark = pytest.mark.slow  # a server process for the module

SECOND = "Water boils at"


def _prompt_reference(offline, prompt, num_top: int) -> tuple[list[int], list]:
    """The offline engine's prompt token ids and prompt logprobs (first entry None)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_top)
    output = offline.generate(prompt, params)[0]
    return output.prompt_token_ids, output.prompt_logprobs


def test_echo_returns_the_prompt_before_the_completion(client, offline):
    expected = greedy(offline, PROMPT, 6).outputs[0].text
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert response.choices[0].text == PROMPT + expected
    assert response.usage.completion_tokens == 6


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_api_does(client, offline):
    ids, reference = _prompt_reference(offline, PROMPT, 2)
    generated = greedy(offline, PROMPT, 3, logprobs=2).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    lp = response.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(reference[i][ids[i]].logprob, abs=1e-4)
        assert lp.tokens[i] == reference[i][ids[i]].decoded_token
        # The top 2 and the prompt's own token (OpenAI's up to logprobs + 1 entries).
        kept = [p for t, p in reference[i].items() if p.rank <= 2 or t == ids[i]]
        top = sorted((p.logprob for p in kept), reverse=True)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-4)
    for j, (token, position) in enumerate(
        zip(generated.token_ids, generated.logprobs, strict=True)
    ):
        assert lp.token_logprobs[n + j] == pytest.approx(position[token].logprob, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    assert "".join(lp.tokens) == response.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt_without_generating(client, offline):
    ids, reference = _prompt_reference(offline, {"prompt_token_ids": list(range(20, 40))}, 1)
    response = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1
    )
    choice = response.choices[0]
    assert choice.text == offline.tokenizer.decode(ids, False)
    assert len(choice.logprobs.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        expected = reference[i][ids[i]].logprob
        assert choice.logprobs.token_logprobs[i] == pytest.approx(expected, abs=1e-4)
    assert response.usage.completion_tokens == 0
    assert choice.finish_reason == "length"
    # Without echo there is nothing to return: refused, naming the field.
    response = httpx.post(
        f"{client.base_url}completions",
        headers=AUTH,
        json={"prompt": PROMPT, "max_tokens": 0},
        timeout=120,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_several_prompts_get_a_choice_each_in_order(client, offline):
    texts = [greedy(offline, p, 5).outputs[0].text for p in (PROMPT, SECOND)]
    response = client.completions.create(
        model=MODEL, prompt=[PROMPT, SECOND], max_tokens=5, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == texts
    ids = [offline.tokenizer.encode(p) for p in (PROMPT, SECOND)]
    assert response.usage.prompt_tokens == sum(len(i) for i in ids)
    assert response.usage.completion_tokens == 10
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == texts
    # Streamed: each chunk names its choice; each choice's chunks join to its text.
    stream = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, SECOND],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    joined, usage = ["", ""], None
    for chunk in stream:
        for choice in chunk.choices:
            joined[choice.index] += choice.text
        usage = chunk.usage or usage
    assert joined == texts
    assert usage.completion_tokens == 10


def test_a_bad_prompt_among_several_is_named(client):
    response = httpx.post(
        f"{client.base_url}completions",
        headers=AUTH,
        json={"prompt": [PROMPT, ""], "max_tokens": 2},
        timeout=120,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt[1]"


def test_completions_default_to_16_tokens(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 16


def test_prompt_logprobs_field_on_both_endpoints(server, client, offline):
    ids, reference = _prompt_reference(offline, PROMPT, 2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    data = httpx.post(f"{server}/v1/completions", headers=AUTH, json=body, timeout=120).json()
    entries = data["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(reference[i][ids[i]].logprob, abs=1e-4)
        assert entry["rank"] == reference[i][ids[i]].rank
        assert all(e["rank"] <= 2 or token == str(ids[i]) for token, e in entries[i].items())
    chat = {"model": MODEL, "messages": SHORT_ANSWER_CHAT, "max_tokens": 1, "prompt_logprobs": 0}
    data = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json=chat, timeout=120).json()
    prompt_ids = offline.tokenizer.apply_chat_template(SHORT_ANSWER_CHAT)
    assert len(data["prompt_logprobs"]) == len(prompt_ids) == data["usage"]["prompt_tokens"]
    assert data["prompt_logprobs"][0] is None
    assert all(
        list(e) == [str(t)]
        for e, t in zip(data["prompt_logprobs"][1:], prompt_ids[1:], strict=True)
    )
    # Streamed: the first chunk carries them.
    with httpx.stream(
        "POST", f"{server}/v1/completions", headers=AUTH, json={**body, "stream": True}, timeout=120
    ) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[0])
    assert len(first["choices"][0]["prompt_logprobs"]) == len(ids)


def test_n_samples_share_the_prompts_prefill_and_reproduce_with_a_seed(server, client, offline):
    prompt = list(range(300, 348))  # 48 tokens: 3 full blocks, in no earlier request
    before = wait_until_idle(server)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3
    )
    after = wait_until_idle(server)
    expected = greedy(offline, {"prompt_token_ids": prompt}, 4).outputs[0].text
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [expected] * 3
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == 48  # the prompt once, as OpenAI and vLLM count it
    # The second and third sample found the first's full blocks (all but the last token's).
    key = "tandem:prefix_cache_hits"
    hits = after[key] - before.get(key, 0.0)
    assert hits >= 2 * 32, hits
    # Seeded sampling: reproducible, the first sample is the request's own seed's.
    seeded = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    first = client.completions.create(**seeded, n=4)
    again = client.completions.create(**seeded, n=4)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1, texts
    assert client.completions.create(**seeded).choices[0].text == texts[0]
    # With several prompts: choice prompt * n + sample; streamed by index too.
    both = client.completions.create(
        model=MODEL, prompt=[PROMPT, SECOND], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text != both.choices[2].text
    stream = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=3, temperature=0, n=2, stream=True
    )
    joined = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            joined[choice.index] += choice.delta.content or ""
    assert joined[0] == joined[1] != ""


def test_usage_counts_each_prompt_once_however_many_samples(client, offline):
    """OpenAI's and vLLM's usage: a prompt's tokens once per prompt, not once per sample
    (``n``, ``best_of``); every generated token, streamed or whole."""
    ids = [offline.tokenizer.encode(p) for p in (PROMPT, SECOND)]
    prompt_tokens = sum(len(i) for i in ids)
    base = {"model": MODEL, "prompt": [PROMPT, SECOND], "max_tokens": 2, "temperature": 0}
    for extra, samples in (({"n": 2}, 2), ({"n": 2, "best_of": 3}, 3)):
        whole = client.completions.create(**base, **extra)
        assert len(whole.choices) == 4
        assert whole.usage.prompt_tokens == prompt_tokens, extra
        assert whole.usage.completion_tokens == 2 * samples * 2, extra
        assert whole.usage.total_tokens == prompt_tokens + 2 * samples * 2
    stream = client.completions.create(
        **base, n=2, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == prompt_tokens
    assert usage[0].completion_tokens == 8
    one = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=2, temperature=0
    )
    two = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=2, temperature=0, n=2
    )
    assert two.usage.prompt_tokens == one.usage.prompt_tokens > 0
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client):
    seeded = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    drawn = client.completions.create(**seeded, n=3, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in drawn.choices]
    ranked = [
        c.text for _, c in sorted(zip(totals, drawn.choices, strict=True), key=lambda p: -p[0])
    ]
    best = client.completions.create(**seeded, best_of=3)
    assert [c.text for c in best.choices] == ranked[:1]
    assert best.choices[0].logprobs is None  # ranked by logprobs it did not ask for
    assert best.usage.completion_tokens == drawn.usage.completion_tokens  # every sample counts
    two = client.completions.create(**seeded, best_of=3, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == ranked[:2]
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}, {"best_of": 129}):
        response = httpx.post(
            f"{client.base_url}completions",
            headers=AUTH,
            json={"prompt": PROMPT, "max_tokens": 2, **bad},
            timeout=120,
        )
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "best_of", bad


def test_penalties_and_logit_bias_give_the_offline_api_s_tokens(client, offline):
    """The four fields through the client (repetition_penalty as vLLM's extra field) give
    what SamplingParams gives offline (tests/e2e/test_penalties.py checks those against a
    reference); the bias bans the unadjusted first token, streamed too."""
    first = greedy(offline, PROMPT, 1).outputs[0].token_ids[0]
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
    bias = {first: -100.0, 13: 2.0}
    expected = greedy(offline, PROMPT, 12, logit_bias=bias, **fields).outputs[0]
    assert expected.token_ids[0] != first
    request = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.4,
        "logit_bias": {str(token): value for token, value in bias.items()},
        "extra_body": {"repetition_penalty": 1.2},
    }
    response = client.completions.create(**request)
    assert response.choices[0].text == expected.text
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)
    )
    assert streamed == expected.text
    chat = greedy_chat(offline, SHORT_ANSWER_CHAT, 10, presence_penalty=1.5)
    response = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=10, temperature=0, presence_penalty=1.5
    )
    assert response.choices[0].message.content == chat.outputs[0].text


def test_structured_output_fields(client, server):
    """response_format json_schema (chat) gives JSON that validates; vLLM's guided_choice
    and guided_regex (completions, as extra fields); a constraint that does not compile is
    a 400 naming the field that asked."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=SHORT_ANSWER_CHAT,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    choice = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["red", "blue"]},
    )
    assert choice.choices[0].text in ("red", "blue")
    for body, param in (
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),
    ):
        response = httpx.post(
            f"{server}/v1/completions",
            headers=AUTH,
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
