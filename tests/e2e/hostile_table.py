"""The parameter table of test_hostile_inputs.py's cases (hostile_cases.py builds them):
the server's limits, hostile values, and each field's values just inside and just outside
its bounds."""

from __future__ import annotations

from tandem.sampling_params import MAX_COUNT, MAX_LOGPROBS, MIN_TEMPERATURE

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # the default model's (test_hostile_inputs.py checks it)
MAX_MODEL_LEN = 128  # the module's server runs with --max-model-len 128
COMPLETIONS, CHAT = "completions", "chat/completions"
CHAT_MESSAGES = [{"role": "user", "content": "Hi"}]
# What every case starts from: a valid request, short and greedy.
BASE = {
    COMPLETIONS: {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
    CHAT: {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 2, "temperature": 0},
}
I64 = 1 << 63
HUGE_INTS = (I64, 1 << 64, 10**30, -I64 - 1, -(10**30))
# Raw JSON number tokens Python's json module reads as non-finite floats.
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e309", "-1e309")
OOV_IDS = (VOCAB_SIZE, VOCAB_SIZE + 1, -1, 1 << 31, *HUGE_INTS)
SURROGATES = ("\ud800", "a\udfffb", "\udbff\udc00\ud800")

# JSON parsers may read UTF-16 and skip a byte order mark (RFC 8259, section 8.1).
READABLE = {"utf16", "bom"}

# field: (values just inside the bounds: accepted, values just outside: refused naming it).
# The output-length fields are set with max_tokens 2 around them (min_tokens <= max_tokens).
BOUNDS = {
    "max_tokens": ([1, 2], [0, -1, MAX_COUNT + 1, I64 - 1]),
    "temperature": ([0, MIN_TEMPERATURE, 0.7, 2, 1e300], [-1e-9, MIN_TEMPERATURE / 2, 5e-324, -1]),
    "top_p": ([1e-9, 0.5, 1], [0, -0.1, 1.0000001, 2]),
    "top_k": ([-1, 0, 1, VOCAB_SIZE - 1, VOCAB_SIZE, I64 - 1], [-2, -I64]),
    "min_p": ([0, 0.5, 1], [-1e-9, 1.0000001]),
    "seed": ([0, -1, I64 - 1, -I64], []),
    "min_tokens": ([0, 1, 2], [-1, 3, MAX_COUNT + 1]),
    "n": ([1, 2], [0, -1, 129]),
    "stop": (["x", ["a", "b"], [], None, "\x00"], ["", [""], [1], SURROGATES[0], [SURROGATES[1]]]),
    "stop_token_ids": ([[0], [VOCAB_SIZE - 1], [], None], [[i] for i in OOV_IDS] + [[1.0]]),
    "presence_penalty": ([-2, 0, 0.5, 2, None], [-2.0000001, 2.5, -3]),
    "frequency_penalty": ([-2, 0, 1, 2, None], [2.1, -2.1]),
    "repetition_penalty": ([0.01, 1, 1.3, 100, None], [0, -1, 0.001, 100.5]),
    "logit_bias": (
        [{"15": 5}, {}, None, {"15": -100, "16": 100}, {str(VOCAB_SIZE - 1): 1.5}],
        [{str(VOCAB_SIZE): 1}, {str(I64): -100}, {"15": 101}, {"15": -100.5}, {"abc": 1}]
        + [{"-1": 1}, {"1.5": 1}, {"": 1}, {"\u0663": 1}],
    ),
    "response_format": (
        [{"type": "text"}, {"type": "json_object"}, None],
        [{"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}, {"type": "xml"}, {}],
    ),
    "guided_regex": (["[a-z]+", None], ["(unclosed", ""]),
    "user": (["u", ""], SURROGATES),
    "model": ([MODEL, None], ["\ud800"]),
}
BOUNDS_COMPLETION = {
    "logprobs": ([0, 1, MAX_LOGPROBS, None], [MAX_LOGPROBS + 1, -1]),
    "prompt": (
        [
            "Hi",
            "\x00",
            [1, 2, 3],
            [0],
            [VOCAB_SIZE - 1],
            ["Hi"],
            [[1, 2]],
            ["a", "b"],  # several prompts: a choice each
            [[1], [2]],
            [1] * (MAX_MODEL_LEN - 3),
        ],
        ["", [], [[]], [""], ["a", ""], [[1], []], [1, "a"], [[1, 2], "a"], [1] * MAX_MODEL_LEN]
        + [[i] for i in OOV_IDS]
        + [[[i]] for i in OOV_IDS[:3]]
        + [[1, i] for i in HUGE_INTS[:2]]
        + list(SURROGATES)
        + [[s] for s in SURROGATES],
    ),
}
# The whole chat: messages and the fields that only chat has.
TEXT = {"type": "text", "text": "Hi"}
BOUNDS_CHAT = {
    "max_completion_tokens": ([1, 2, None], [0, -1, MAX_COUNT + 1]),
    "top_logprobs": ([None], [0, 1]),  # without logprobs: true
    "messages": (
        [
            CHAT_MESSAGES,
            [{"role": "system", "content": "Be brief."}, *CHAT_MESSAGES],
            [{"role": "user", "content": [TEXT, TEXT]}],
            [{"role": "user", "content": [{"type": "text", "text": ""}]}],
            [{"role": "user", "content": "Hi", "name": "bob"}],
            [*CHAT_MESSAGES, {"role": "assistant", "content": None}],
            [{"role": "developer", "content": "x"}, *CHAT_MESSAGES],
            [{"role": "user", "content": "\x00"}],
        ],
        [
            [],
            [{}],
            [{"content": "Hi"}],
            [{"role": "wizard", "content": "Hi"}],
            [{"role": "USER", "content": "Hi"}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            [{"role": "user", "content": [{"type": "text", "text": ["Hi"]}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"text": "Hi"}]}],
            [{"role": "user", "content": [{"type": 5, "text": "Hi"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            [{"role": "user", "content": [{"type": "text", "text": "Hi", "extra": 1}]}],
            [{"role": "user", "content": [{"type": "x" * 100}]}],
            [{"role": "user", "content": [[["nested"]]]}],
            [{"role": "user", "content": [5]}],
            [{"role": "user", "content": [None]}],
            [{"role": "user", "content": {"type": "text", "text": "Hi"}}],
            [{"role": "user", "content": [TEXT, {"type": "text", "text": {"deep": [1, {}]}}]}],
            [{"role": "user", "content": "x " * (MAX_MODEL_LEN * 2)}],
            [CHAT_MESSAGES[0], "Hi"],
        ]
        + [[{"role": "user", "content": s}] for s in SURROGATES]
        + [[{"role": "user", "content": [{"type": "text", "text": s}]}] for s in SURROGATES]
        + [[{"role": "user", "content": "Hi", "name": SURROGATES[0]}]]
        + [[{"role": "user", "content": [{"type": s, "text": "Hi"}]}] for s in SURROGATES[:1]],
    ),
}
