"""The MTP training data's prompts for the base's own replies to users' later turns
(``later_turn_prompts``), with the default model's real tokenizer and chat template."""

from __future__ import annotations

import pytest

from tandem.models.loader import default_model_path
from tandem.tokenizer import Tokenizer
from tandem.train.mtp_data import later_turn_prompts, sharegpt_messages


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def record(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


CHAT = record(
    ("human", "Name a colour."),
    ("gpt", "Blue."),
    ("human", "Another one?"),
    ("gpt", "Green. " * 40),
    ("human", "And a third?"),
)


def test_each_later_turn_gets_its_conversation_up_to_it(tokenizer):
    prompts = later_turn_prompts(tokenizer, [CHAT], 10, 10_000)
    messages = sharegpt_messages(CHAT)
    # The first turn has no reply before it; the second and third do.
    assert prompts == [
        tokenizer.apply_chat_template(messages[:3]),
        tokenizer.apply_chat_template(messages[:5]),
    ]
    assert tokenizer.decode(prompts[1]).rstrip().endswith("assistant")


def test_a_long_conversation_keeps_the_latest_turns_that_fit(tokenizer):
    messages = sharegpt_messages(CHAT)
    whole = len(tokenizer.apply_chat_template(messages[:5]))
    latest = tokenizer.apply_chat_template(messages[2:5])  # from the second user turn on
    prompts = later_turn_prompts(tokenizer, [CHAT], 10, len(latest))
    assert len(latest) < whole and prompts[-1] == latest
    # Too short for a turn with the reply before it: that turn is skipped.
    assert later_turn_prompts(tokenizer, [CHAT], 10, len(latest) - 1) == prompts[:1]
    assert later_turn_prompts(tokenizer, [CHAT], 10, 5) == []


def test_turns_without_a_reply_before_them_and_the_cap(tokenizer):
    doubled = record(
        ("human", "Hi."), ("human", "Still there?"), ("gpt", "Yes."), ("human", "Good.")
    )
    prompts = later_turn_prompts(tokenizer, [doubled, CHAT], 10, 10_000)
    # "Still there?" follows a user turn; "Good." follows a reply (context from "Hi.").
    assert len(prompts) == 3
    assert tokenizer.decode(prompts[0]).count("Still there?") == 1
    assert later_turn_prompts(tokenizer, [doubled, CHAT], 2, 10_000) == prompts[:2]
    assert later_turn_prompts(tokenizer, [{"conversations": None}, {}], 5, 10_000) == []
