"""Overlap scheduling changes nothing a client sees (DESIGN.md, overlap section): tokens,
text, logprobs and finish reasons are identical with overlap on and off, for plain decoding
and MTP (k = 1..4), greedy and seeded sampling, stop strings, preemption, chunked prefill
and prefix hits. Requests aborted or finished while a step is in flight leak no block and are
never freed twice, and the host waits for the device at most once per step."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from chat_prompts import mtbench_chat_prompts
from host_reads import HostReads

from tandem import SamplingParams
from tandem.bench.datasets import load_mtbench

pytestmark = pytest.mark.slow  # each case: engines with and without overlap over 16 prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(llm_cache):
    return mtbench_chat_prompts(llm_cache, 1, 5, 16)


def _outputs(llm, prompts, params) -> list[tuple]:
    results = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].logprobs,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
        )
        for o in results
    ]


def _seeded(**kwargs) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, logprobs=3, **kwargs
        )
        for i in range(16)
    ]


PARAMS = {
    "greedy": lambda: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5),
    "seeded": _seeded,
    "stop_strings": lambda: SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop=[".", " the"], logprobs=1
    ),
    "min_tokens": lambda: SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=20, stop_token_ids=[13, 28, 30]
    ),
}


LOGPROB_TOLERANCE = 1e-4  # the tolerance of every fp32 logprob comparison here


def assert_same(overlapped: list[tuple], sequential: list[tuple]) -> None:
    """Tokens, text, finish and stop reasons equal; logprobs of the same tokens with the
    same ranks, values within 1e-4. (A request that ends by a stop string still has its
    next row in flight, so later steps run a batch of another shape, and fp32 sums in
    another order differ in the last bits: up to about 1e-5 here.)"""
    assert len(overlapped) == len(sequential)
    for got, expected in zip(overlapped, sequential, strict=True):
        assert got[0] == expected[0] and got[1:2] == expected[1:2] and got[3:] == expected[3:]
        if expected[2] is None:
            assert got[2] is None
            continue
        for got_entry, expected_entry in zip(got[2], expected[2], strict=True):
            assert got_entry.keys() == expected_entry.keys()
            for token, logprob in expected_entry.items():
                assert got_entry[token].rank == logprob.rank
                assert abs(got_entry[token].logprob - logprob.logprob) <= LOGPROB_TOLERANCE


def _same(make_llm, prompts, params, **engine) -> None:
    sequential = _outputs(make_llm(overlap=False, **engine), prompts, params)
    overlapped = _outputs(make_llm(overlap=True, **engine), prompts, params)
    assert_same(overlapped, sequential)


@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_plain_decoding_is_identical_with_overlap(make_llm, prompts, mode):
    _same(make_llm, prompts, PARAMS[mode]())


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_invariant_lossless_mtp_is_identical_with_overlap(make_llm, prompts, k):
    _same(make_llm, prompts, PARAMS["greedy"](), speculative="mtp", num_speculative_tokens=k)


@pytest.mark.parametrize("mode", ["seeded", "stop_strings", "min_tokens"])
def test_mtp_sampling_and_stops_are_identical_with_overlap(make_llm, prompts, mode):
    _same(make_llm, prompts, PARAMS[mode](), speculative="mtp", num_speculative_tokens=3)


def test_overlap_with_preemption_chunked_prefill_and_prefix_hits(make_llm, prompts):
    # Half the prompts in half the blocks: preemption and prefix hits as often, in half the
    # time (the metrics below check both happen).
    prompts = prompts[::2]
    engine = {
        "speculative": "mtp",
        "num_speculative_tokens": 3,
        "num_kv_blocks": 24,
        "max_num_batched_tokens": 64,
    }
    sequential = make_llm(overlap=False, **engine)
    overlapped = make_llm(overlap=True, **engine)
    params = PARAMS["greedy"]()
    before = overlapped.get_metrics()
    first = _outputs(overlapped, prompts, params)
    second = _outputs(overlapped, prompts, params)  # the prompts are in the prefix cache now
    after = overlapped.get_metrics()
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    expected = _outputs(sequential, prompts, params)
    assert_same(first, expected)
    assert_same(second, expected)


class FreeLog:
    """Counts, per request, the frees that actually released blocks."""

    def __init__(self, block_manager):
        self.released: Counter = Counter()
        self.block_manager = block_manager
        self.inner = block_manager.free

    def __call__(self, request) -> None:
        if self.block_manager.block_ids(request.request_id):
            self.released[request.request_id] += 1
        self.inner(request)


def _with_free_log(llm, monkeypatch) -> FreeLog:
    log = FreeLog(llm.engine.block_manager)
    monkeypatch.setattr(llm.engine.block_manager, "free", log)
    return log


def test_invariant_block_accounting_aborts_in_flight_leak_nothing_and_free_once(
    make_llm, prompts, monkeypatch
):
    llm = make_llm(overlap=True, speculative="mtp", num_speculative_tokens=3)
    log = _with_free_log(llm, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    ids = [llm.add_request(p, params) for p in prompts]
    aborted: set[str] = set()
    steps = 0
    while llm.engine.has_unfinished_requests():
        outputs = llm.step()
        steps += 1
        assert not any(o.request_id in aborted for o in outputs), "an aborted request got output"
        if steps in (2, 3, 5):  # a step is in flight each time: abort while it runs
            assert llm.engine._in_flight is not None
            victims = [i for i in ids[steps::4] if i not in aborted]
            for request_id in victims:
                llm.abort_request(request_id)
            aborted.update(victims)
    assert aborted
    assert llm.engine.block_manager.all_blocks_free()
    assert set(log.released) == set(ids)
    assert max(log.released.values()) == 1, "a request's blocks were freed twice"
    assert not llm.engine.pipeline.batch.states, "the worker kept state of ended requests"


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_requests_finishing_in_flight_match_and_free_once(
    make_llm, prompts, monkeypatch, speculative
):
    """max_tokens of 1..4 and an end token in the accepted run: each request ends while its
    follow-up row is already in flight."""
    engine = {"speculative": speculative, "num_speculative_tokens": 3} if speculative else {}
    overlapped = make_llm(overlap=True, **engine)
    log = _with_free_log(overlapped, monkeypatch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=1 + i % 4, logprobs=1)
        if i % 2
        else SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[30])
        for i in range(16)
    ]
    expected = _outputs(make_llm(overlap=False, **engine), prompts, params)
    assert_same(_outputs(overlapped, prompts, params), expected)
    assert overlapped.engine.block_manager.all_blocks_free()
    assert len(log.released) == 16 and max(log.released.values()) == 1


@pytest.mark.parametrize("engine", ["plain", "mtp"])
def test_invariant_one_wait_per_step_host_waits_for_the_device_at_most_once_per_step(
    make_llm, prompts, monkeypatch, engine
):
    """Every read of a tensor's values on the host (.tolist(), .item(), bool(), ...) outside
    the runner's DeviceReader is counted: there must be none, and the reader waits at most
    once per step, with sampling, logprobs and prompt logprobs all on, plain and with MTP."""
    options = {"speculative": "mtp", "num_speculative_tokens": 3} if engine == "mtp" else {}
    llm = make_llm(overlap=True, **options)
    pipeline = llm.engine.pipeline
    reads = HostReads(monkeypatch)
    execute_counted = reads.counted(pipeline.step_ahead, pipeline.reader)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            max_tokens=16,
            logprobs=2,
            prompt_logprobs=1 if i % 4 == 0 else None,
            min_tokens=3,
        )
        for i in range(16)
    ]
    pipeline.step_ahead = execute_counted
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del pipeline.step_ahead
    assert len(reads.waits) >= 5
    assert max(reads.waits) <= 1, f"a step waited for the device {max(reads.waits)} times"
    assert not reads.stray, f"host reads outside the one wait per step: {dict(reads.stray)}"


def test_plain_decoding_queues_the_next_step_before_reading(make_llm, prompts, monkeypatch):
    """With overlap and no MTP, a decode step is launched while the step before it is
    unread: its input token comes from that step's samples on the device."""
    llm = make_llm(overlap=True)
    runner = llm.engine.runner
    forward = runner.forward
    fed_from_device: list[int] = []

    def recording_forward(inputs):
        fed_from_device.append(len(inputs.pending_index))
        return forward(inputs)

    monkeypatch.setattr(runner, "forward", recording_forward)
    llm.generate(prompts, PARAMS["greedy"](), use_tqdm=False)
    assert sum(fed_from_device) >= MAX_TOKENS * len(prompts) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", ["mixed", "greedy", "whole"])
def test_no_hidden_synchronization_on_cuda(sampling):
    """On the GPU, torch's sync debug mode turns any implicit synchronization (a blocking
    copy, .item(), a data-dependent shape) into an error; only the DeviceReader's explicit
    stream wait remains: with greedy and sampled rows and with greedy rows alone, all with
    logprobs (MTP steps resolved on the device, launched ahead and replayed as the sampled
    family of step graphs); "whole": sampled and greedy rows four at a time with steps going
    whole (as on a model over 2 GiB), so prompt chunks share a forward with resolved rows.
    TANDEM_MODEL names the model file where the default package is not installed."""
    from tandem import LLM

    whole = sampling == "whole"
    llm = LLM(
        model=os.environ.get("TANDEM_MODEL"),
        device="cuda",
        overlap=True,
        speculative="mtp",
        num_speculative_tokens=3,
        kv_cache_memory_gb=4,
        **({"max_num_seqs": 4} if whole else {}),
    )
    llm.engine.pipeline.split_steps = not whole
    prompts = [
        {
            "prompt_token_ids": llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q["turns"][0]}]
            )
        }
        for q in load_mtbench()[:16]
    ]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 or sampling == "greedy" else 0.9,
            seed=i,
            max_tokens=16,
            logprobs=2,
        )
        for i in range(16)
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: allocations, pinning
    resolved_before = llm.engine.pipeline.num_resolved_steps
    pipeline = llm.engine.pipeline
    replays_before = pipeline.mtp.step_graphs.num_replays
    calls = []

    def strict(method):
        def run(step):
            calls.append(method.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    # With overlap the engine calls step_ahead (execute only without it): check both.
    pipeline.execute, pipeline.step_ahead = strict(pipeline.execute), strict(pipeline.step_ahead)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del pipeline.execute, pipeline.step_ahead
        llm.engine.shutdown()
    # The strict mode was on for every step (14 with these prompts on the H200).
    assert len(calls) >= 8 and set(calls) == {"step_ahead"}
    assert pipeline.num_resolved_steps > resolved_before
    assert pipeline.num_mixed_steps > 0 or not whole
    assert pipeline.mtp.step_graphs.num_replays > replays_before


@pytest.mark.gpu
def test_overlap_is_identical_on_cuda():
    """fp32 on the GPU: greedy tokens and logprobs with overlap on and off, plain and MTP."""
    from tandem import LLM

    model = os.environ.get("TANDEM_MODEL")
    params = PARAMS["greedy"]()
    for engine in ({}, {"speculative": "mtp", "num_speculative_tokens": 3}):
        results = []
        for overlap in (False, True):
            llm = LLM(
                model=model,
                device="cuda",
                dtype="float32",
                overlap=overlap,
                kv_cache_memory_gb=4,
                **engine,
            )
            prompts = [
                {
                    "prompt_token_ids": llm.tokenizer.apply_chat_template(
                        [{"role": "user", "content": q["turns"][0]}]
                    )
                }
                for q in load_mtbench()[:16]
            ]
            results.append(_outputs(llm, prompts, params))
            llm.engine.shutdown()
        assert_same(results[1], results[0])
