"""PD disaggregation at the engine-core level, in one process: a prefill core and a decode
core joined by their ZeroMQ control channels and an in-process KV connector. What a
decode instance reports equals what a mixed instance reports (tokens, logprobs, prompt
logprobs, finish reasons; greedy and seeded, with and without MTP); the first token can end
a request on the decode side at once; failures end requests with an error in bounded time;
no block is leaked on either side.

The three-process version over HTTP and the Mooncake connector is tests/e2e/test_pd_serve.py.
"""

from __future__ import annotations

import time

import pytest
from host_reads import HostReads
from pd_steps import assert_no_leak, compare, run, settle, submit

from tandem.bench.datasets import load_mtbench
from tandem.config import CacheConfig, DisaggConfig, EngineConfig, SpeculativeConfig
from tandem.core.engine_core import EngineCore
from tandem.disagg.kv_connector import LocalKVConnector
from tandem.disagg.setup import start_pd_role
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # a prefill/decode pair and a mixed engine core, plain and with MTP

MAX_TOKENS = 16
NUM_BLOCKS = 256
SECRET = "test-pd-core-shared-secret"


def _config(role: str, mtp: bool, timeout_s: float = 30.0) -> EngineConfig:
    spec = SpeculativeConfig("mtp", 3) if mtp else SpeculativeConfig()
    return EngineConfig(
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
        speculative=spec,
        disagg=DisaggConfig(role=role, transfer_timeout_s=timeout_s, secret=SECRET),
    )


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.models.loader import resolve_model

    return Tokenizer.from_model_path(resolve_model(None))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    questions = [q["turns"][0] for q in load_mtbench()[2::5]][:16]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "mtp"])
def cores(request):
    """(mixed, prefill, decode) engine cores; the module shares them per mode."""
    mtp = request.param
    registry: dict = {}
    mixed = EngineCore(_config("mixed", mtp))
    prefill = EngineCore(_config("prefill", mtp))
    start_pd_role(prefill, LocalKVConnector(registry, "prefill"))
    decode = EngineCore(_config("decode", mtp))
    start_pd_role(decode, LocalKVConnector(registry, "decode"))
    yield mixed, prefill, decode
    for core in (mixed, prefill, decode):
        core.shutdown()


def _params(tokenizer, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(eos_token_ids=frozenset(tokenizer.end_token_ids), **kwargs)


# Logit bias, penalties and structured output (the prefill instance's first token adjusted
# and constrained too: a repetition penalty over the prompt changes it, a grammar fixes it).
ADJUSTED = [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.2, "frequency_penalty": 0.6},
    {"logit_bias": {13: -100.0, 28: 3.0}, "frequency_penalty": 0.3},
    {},
    {"guided": {"choice": ["yes", "no", "maybe"]}},
    {"guided": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
]


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "adjusted"])
def test_invariant_lossless_decode_instance_reports_what_a_mixed_instance_reports(
    cores, prompts, tokenizer, sampling
):
    mixed, prefill, decode = cores
    if sampling == "greedy":
        params = [_params(tokenizer, temperature=0.0, logprobs=3, prompt_logprobs=2)] * 16
    elif sampling == "adjusted":
        params = [
            _params(
                tokenizer,
                temperature=0.0 if i % 3 else 0.8,
                seed=i,
                logprobs=2,
                **ADJUSTED[i % len(ADJUSTED)],
            )
            for i in range(16)
        ]
    else:
        params = [
            _params(tokenizer, temperature=0.8, top_p=0.95, seed=7 + i, logprobs=2)
            for i in range(16)
        ]
    ids = [f"{sampling}-{i}" for i in range(16)]
    submit(mixed, ids, prompts, params, None)
    want = run([mixed], mixed, set(ids))
    drafts_before = decode.scheduler.spec_num_drafts
    submit(decode, ids, prompts, params, prefill.control_address)
    got = run([prefill, decode], decode, set(ids))
    compare(got, want)
    if decode.runner.proposer is not None:  # each first step verified handed-over drafts
        assert decode.scheduler.spec_num_drafts - drafts_before >= len(ids)
    assert all(len(got[i]["logprobs"]) == len(got[i]["tokens"]) for i in ids)
    if sampling == "greedy":  # every prompt token but the first has its logprobs
        assert all(
            len(got[i]["prompt_logprobs"]) == len(p) - 1 for i, p in zip(ids, prompts, strict=True)
        )
    settle([prefill, decode])
    assert_no_leak(prefill, decode)


def test_invariant_one_wait_per_step_on_both_instances(cores, prompts, tokenizer, monkeypatch):
    """Every read of a tensor's values on the host outside the runners' DeviceReaders is
    counted while the prefill and decode instances step (the prefill side hands over the
    drafts it made, picking up their copies once done, ``DeviceReader.take``; the decode
    side inserts them into its slots): there must be none, and each engine step waits for
    its device at most once. Sampled and greedy rows, logprobs."""
    _, prefill, decode = cores
    reads = HostReads(monkeypatch)
    for core in (prefill, decode):
        monkeypatch.setattr(core, "step", reads.counted(core.step, core.pipeline.reader))
    params = [
        _params(tokenizer, temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=8, logprobs=2)
        for i in range(8)
    ]
    ids = [f"one-wait-{i}" for i in range(8)]
    resolved_before = decode.pipeline.num_resolved_steps
    submit(decode, ids, prompts[:8], params, prefill.control_address)
    got = run([prefill, decode], decode, set(ids))
    if decode.runner.proposer is not None:  # handed-over slots let decode steps resolve
        assert decode.pipeline.num_resolved_steps > resolved_before
    assert all(r["error"] is None and len(r["tokens"]) == 8 for r in got.values()), got
    assert len(reads.waits) >= 10
    assert max(reads.waits) <= 1, f"an engine step waited {max(reads.waits)} times"
    assert not reads.stray, f"host reads outside the one wait per step: {dict(reads.stray)}"
    monkeypatch.undo()
    settle([prefill, decode])
    assert_no_leak(prefill, decode)


def test_first_token_ends_the_request_on_the_decode_side(cores, prompts, tokenizer):
    """EOS as the first token (a stop token id holding the token the model produces
    first), max_tokens = 1: the decode side finishes at once, with that token's logprobs."""
    mixed, prefill, decode = cores
    submit(mixed, ["probe"], prompts[:1], [_params(tokenizer, temperature=0.0, max_tokens=1)], None)
    first = run([mixed], mixed, {"probe"})["probe"]["tokens"][0]
    cases = {
        "eos-first": _params(tokenizer, temperature=0.0, stop_token_ids=[first], logprobs=1),
        "one-token": _params(tokenizer, temperature=0.0, max_tokens=1, logprobs=1),
    }
    submit(decode, list(cases), prompts[:1] * 2, list(cases.values()), prefill.control_address)
    got = run([prefill, decode], decode, set(cases))
    assert got["eos-first"]["tokens"] == [first]
    assert (got["eos-first"]["finish"], got["eos-first"]["stop"]) == ("stop", first)
    assert got["one-token"]["tokens"] == [first] and got["one-token"]["finish"] == "length"
    for result in got.values():
        assert len(result["logprobs"]) == 1 and result["logprobs"][0][0] == first
    settle([prefill, decode])
    assert_no_leak(prefill, decode)


def test_invariant_no_hang_silent_prefill_instance_times_out_with_an_error(
    cores, prompts, tokenizer, monkeypatch
):
    """A prefill instance that never answers (never stepped here, and its engine loop taken
    as stuck at once, so its inbox thread does not report the request): the request ends
    with an error after the decode side's timeout (2 s here), and its blocks come back after
    a second timeout, when no late write can arrive."""
    monkeypatch.setattr("tandem.disagg.liveness.STALLED_AFTER_TIMEOUTS", 0)
    _, prefill, decode = cores
    decode.pd.timeout_s = 2.0
    start = time.monotonic()
    submit(
        decode,
        ["silent"],
        prompts[:1],
        [_params(tokenizer, temperature=0.0)],
        prefill.control_address,
    )
    result = run([decode], decode, {"silent"})["silent"]
    elapsed = time.monotonic() - start
    assert result["finish"] == "error" and "within 2 s" in result["error"]
    assert 2.0 <= elapsed < 4.0
    assert decode.block_manager.num_free_blocks < decode.num_blocks  # held, not reused
    settle([decode])
    assert time.monotonic() - start >= 4.0
    decode.pd.timeout_s = 30.0
    # The prefill instance now receives the stale request and the cancel: it must not
    # leak either.
    settle([prefill, decode])
    assert_no_leak(prefill, decode)


def test_invariant_block_accounting_unreachable_prefill_and_aborts_leak_nothing(
    cores, prompts, tokenizer
):
    _, prefill, decode = cores
    params = [_params(tokenizer, temperature=0.0)] * 3
    submit(decode, ["abort-a", "abort-b", "abort-c"], prompts[:3], params, prefill.control_address)
    decode.step()  # asks the prefill instance for all three
    decode.abort_request("abort-a")  # before any KV arrived
    run([prefill, decode], decode, {"abort-b", "abort-c"})
    settle([prefill, decode])
    assert_no_leak(prefill, decode)


def test_a_mixed_instance_refuses_remote_prefill(cores, prompts, tokenizer):
    mixed, prefill, _ = cores
    request = Request("refused", list(prompts[0]), _params(tokenizer))
    request.remote_prefill = prefill.control_address
    with pytest.raises(ValueError, match="only a decode instance"):
        mixed.add_request(request)
