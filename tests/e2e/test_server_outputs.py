"""The OpenAI-compatible server, end to end, through the official ``openai`` client: health,
models and metrics; completions and chat against the offline engine (text, token ids,
``max_tokens``), streamed and not; logprobs; stop strings and seeds.

The offline ``LLM`` beside the module's server gives the reference outputs and logprobs
(fixtures: conftest.py; helpers: server_helpers.py).
"""

from __future__ import annotations

import re

import httpx
import pytest
from server_helpers import (
    AUTH,
    GAUGES,
    LONG_ANSWER_CHAT,
    MODEL,
    PROMPT,
    SHORT_ANSWER_CHAT,
    assert_idle,
    greedy,
    greedy_chat,
    metrics,
    wait_until_idle,
)

pytestmark = pytest.mark.slow  # a server process for the module


# ---- endpoints ---------------------------------------------------------------------------


def test_health_models_and_metrics(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]

    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    for name in GAUGES:
        assert re.search(rf"^{re.escape(name)}\{{.*\}} \S+$", text, re.MULTILINE), name
    assert re.search(
        r'^tandem:request_success_total\{.*finished_reason="(length|stop)"', text, re.MULTILINE
    )
    m = metrics(server)
    assert m["tandem:num_kv_blocks"] > 0
    assert 0 <= m["tandem:kv_cache_usage_perc"] <= 1
    assert m["tandem:generation_tokens_total"] >= 2


# ---- greedy outputs against the offline API ----------------------------------------------


def test_completion_string_prompt_matches_offline(client, offline):
    expected = greedy(offline, PROMPT, 12)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert response.model == MODEL and response.object == "text_completion"
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids) == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_token_id_prompt_matches_offline(client, offline):
    ids = offline.tokenizer.encode("Once upon a time")
    expected = greedy(offline, {"prompt_token_ids": ids}, 10)
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == len(ids) + 10


@pytest.mark.parametrize(
    ("messages", "max_tokens", "finish_reason"),
    [(SHORT_ANSWER_CHAT, 32, "stop"), (LONG_ANSWER_CHAT, 6, "length")],
)
def test_chat_completion_matches_offline(client, offline, messages, max_tokens, finish_reason):
    expected = greedy_chat(offline, messages, max_tokens)
    assert expected.outputs[0].finish_reason == finish_reason  # the premise of the case
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == finish_reason
    n_generated = len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == n_generated
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + n_generated


def test_max_tokens_is_honoured(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"
    # Chat accepts max_completion_tokens (the newer name) too.
    response = client.chat.completions.create(
        model=MODEL, messages=LONG_ANSWER_CHAT, max_completion_tokens=3, temperature=0
    )
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


# ---- streaming ---------------------------------------------------------------------------


def test_streaming_completion_joins_to_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) >= 2
    assert "".join(c.choices[0].text for c in with_choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * (
        len(with_choices) - 1
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_joins_to_the_whole_text(client, offline):
    whole = client.chat.completions.create(
        model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=32, temperature=0
    )
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=SHORT_ANSWER_CHAT,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # Without include_usage there is no usage chunk.
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=SHORT_ANSWER_CHAT, max_tokens=32, temperature=0, stream=True
        )
    )
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text


# ---- logprobs ----------------------------------------------------------------------------


def _check_top(top: list[float], chosen: float, reference: list[float]) -> None:
    assert len(top) == 3
    assert top == sorted(top, reverse=True)
    assert top[0] == pytest.approx(chosen, abs=1e-5)  # greedy picks the most likely token
    assert top == pytest.approx(reference, abs=1e-5)


def test_completion_logprobs_match_offline(client, offline):
    expected = greedy(offline, PROMPT, 8, logprobs=3).outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = response.choices[0].logprobs
    assert response.choices[0].text == expected.text
    assert len(lp.token_logprobs) == len(expected.token_ids) == 8
    for i, (token, position) in enumerate(zip(expected.token_ids, expected.logprobs, strict=True)):
        assert lp.tokens[i] == position[token].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(position[token].logprob, abs=1e-5)
        reference = sorted((p.logprob for p in position.values() if p.rank <= 3), reverse=True)
        _check_top(list(lp.top_logprobs[i].values()), lp.token_logprobs[i], reference)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs_match_offline(client, offline):
    expected = greedy_chat(offline, LONG_ANSWER_CHAT, 8, logprobs=3).outputs[0]
    response = client.chat.completions.create(
        model=MODEL,
        messages=LONG_ANSWER_CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert response.choices[0].message.content == expected.text
    assert len(content) == len(expected.token_ids) == 8
    for entry, token, position in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert entry.token == position[token].decoded_token
        assert entry.logprob == pytest.approx(position[token].logprob, abs=1e-5)
        reference = sorted((p.logprob for p in position.values() if p.rank <= 3), reverse=True)
        _check_top([t.logprob for t in entry.top_logprobs], entry.logprob, reference)
    # logprobs without top_logprobs: the chosen token only.
    response = client.chat.completions.create(
        model=MODEL, messages=LONG_ANSWER_CHAT, max_tokens=3, temperature=0, logprobs=True
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 3 and all(e.top_logprobs == [] for e in content)


# ---- stop strings and seeds --------------------------------------------------------------


def test_stop_strings_cut_the_text(server, client, offline):
    full = greedy(offline, PROMPT, 16).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    assert cut and len(cut) < len(full)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["never appears", stop]
    )
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    stopped = greedy(offline, PROMPT, 16, stop=stop).outputs[0]
    assert stopped.text == cut
    assert response.usage.completion_tokens == len(stopped.token_ids) < 16
    # Streamed, the stop string is cut the same way.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # A request ended by a stop string releases everything it held.
    assert_idle(wait_until_idle(server, timeout=10))


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1
