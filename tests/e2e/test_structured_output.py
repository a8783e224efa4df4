"""Structured output (xgrammar): 20 JSON schemas whose greedy outputs parse and validate,
the same with MTP k = 3 (the shipped head) and overlap as without (drafts the grammar
forbids are rejected, so speculation stays lossless); json_object, regex, choice and an EBNF
grammar; a constraint that does not compile is refused at admission, naming the field.
(PD: tests/e2e/test_pd_core.py's guided case; HTTP: tests/e2e/test_server_prompts.py.)"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem import SamplingParams
from tandem.sampling_params import ParamError

pytestmark = pytest.mark.slow  # two engines over 24 constrained requests

MAX_TOKENS = 80
TEXT = {"type": "string", "maxLength": 12}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    {"type": "object", "properties": {"name": TEXT}, "required": ["name"]},
    {"type": "object", "properties": {"age": SMALL}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"name": TEXT, "age": SMALL},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": TEXT, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": TEXT, "minItems": 2, "maxItems": 2},
    {"enum": ["yes", "no"]},
    {"type": "string", "maxLength": 20},
    {"type": "integer", "minimum": 1, "maximum": 10},
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {
            "city": TEXT,
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "where"],
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "n": SMALL},
        "required": ["kind", "n"],
    },
    {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["note"],
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": SMALL, "maxItems": 3}, "total": SMALL},
        "required": ["items", "total"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"}},
        "required": ["id"],
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "object", "properties": {"name": TEXT}, "required": ["name"]},
            }
        },
        "required": ["people"],
    },
]
OTHERS = [
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ({"regex": "[A-Z][a-z]{2,8} [0-9]{2}"}, re.compile("[A-Z][a-z]{2,8} [0-9]{2}").fullmatch),
    ({"choice": ["alpha", "beta", "gamma"]}, lambda text: text in ("alpha", "beta", "gamma")),
    ({"grammar": 'root ::= "A" | "B" ("x" | "y")*'}, re.compile("A|B[xy]*").fullmatch),
]
MTP = {"speculative": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def requests(offline):
    tokenizer = offline.tokenizer
    asks = [f"Answer in JSON matching this schema: {json.dumps(s)}" for s in SCHEMAS]
    asks += ["Give a JSON object.", "A name and a number.", "Pick one.", "A or B?"]
    prompts = [
        {"prompt_token_ids": tokenizer.apply_chat_template([{"role": "user", "content": a}])}
        for a in asks
    ]
    guided = [{"json": s} for s in SCHEMAS] + [g for g, _ in OTHERS]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, guided=g) for g in guided]
    return prompts, params


def _waits_per_step(llm):
    """A function giving the host's waits for the device per engine step since now."""
    reader = llm.engine.pipeline.reader
    waits, steps = reader.num_waits, llm.get_metrics()["num_steps"]
    return lambda: (reader.num_waits - waits) / (llm.get_metrics()["num_steps"] - steps)


def _check(outputs) -> None:
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)
        if i < len(SCHEMAS):
            jsonschema.validate(json.loads(completion.text), SCHEMAS[i])
        else:
            assert OTHERS[i - len(SCHEMAS)][1](completion.text), (i, completion.text)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_outputs_obey_their_constraints_and_mtp_changes_nothing(make_llm, requests, overlap):
    prompts, params = requests
    engine = make_llm(overlap=overlap)
    waits = _waits_per_step(engine)
    plain = engine.generate(prompts, params, use_tqdm=False)
    assert waits() <= 1  # DESIGN.md invariant 6 holds for constrained rows
    _check(plain)
    mtp = make_llm(overlap=overlap, **MTP)
    before = mtp.get_metrics()
    waits = _waits_per_step(mtp)
    speculated = mtp.generate(prompts, params, use_tqdm=False)
    # With MTP a step with constrained rows reads their drafts too: one more wait, no other.
    assert waits() <= 2
    after = mtp.get_metrics()
    for got, want in zip(speculated, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # Drafts were verified against the grammar, and some accepted.
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]


def test_a_constraint_that_does_not_compile_is_refused_naming_it(make_llm):
    llm = make_llm(overlap=True)
    for guided in ({"regex": "(unclosed"}, {"grammar": "root ::= missing"}, {"json": "{"}):
        with pytest.raises(ParamError) as error:
            llm.generate("Hi", SamplingParams(max_tokens=4, guided=guided), use_tqdm=False)
        assert error.value.param == "guided"
    with pytest.raises(ParamError, match="exactly one"):
        SamplingParams(guided={"regex": "a", "choice": ["b"]})
    with pytest.raises(ParamError, match="min_tokens"):
        SamplingParams(guided={"regex": "a"}, min_tokens=2)
    # The engine serves on.
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text
