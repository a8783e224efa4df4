"""Scheduler: batching under the token budget, chunked prefill, max_num_seqs, FCFS, preemption
by recompute, stop conditions, abort/finish. Driven with fake ModelRunnerOutput objects: every
row that samples gets token ``1000 + step`` unless a test says otherwise."""

from __future__ import annotations

import zlib

import pytest

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.scheduler import Scheduler
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.step import ModelRunnerOutput, SchedulerOutput

BS = 4  # block size used throughout


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    block_manager = BlockManager(num_blocks, BS, enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len)


def make_request(request_id: str, prompt, **params) -> Request:
    if isinstance(prompt, int):
        base = zlib.crc32(request_id.encode()) % 500  # deterministic, distinct per id
        prompt = [base + i for i in range(prompt)]
    return Request(request_id, list(prompt), SamplingParams(**params))


class Driver:
    """Runs schedule -> fake runner -> update_from_output and records what happened."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.step_no = 0
        self.emitted: dict[str, list[int]] = {}

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def fake_output(self, out: SchedulerOutput, tokens=None) -> ModelRunnerOutput:
        """Sampled tokens for every row that samples (``row.samples`` before the update)."""
        sampled = {}
        for row in out.scheduled:
            if row.samples:
                rid = row.request.request_id
                if tokens is not None and rid in tokens:
                    sampled[rid] = list(tokens[rid])
                else:
                    sampled[rid] = [1000 + self.step_no]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def update(self, out: SchedulerOutput, tokens=None):
        runner_output = self.fake_output(out, tokens)
        self.step_no += 1
        return self.scheduler.update_from_output(out, runner_output)

    def step(self, tokens=None):
        out = self.schedule()
        return out, self.update(out, tokens)

    def run(self, max_steps: int = 2000, tokens=None, check=None) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished_requests():
            assert len(outs) < max_steps, "scheduler made no progress"
            out = self.schedule()
            if check is not None:
                check(out)
            self.update(out, tokens)
            outs.append(out)
        return outs


def ids(out: SchedulerOutput) -> list[str]:
    return [row.request.request_id for row in out.scheduled]


# ---- batching and chunked prefill ----------------------------------------------------------


def test_batch_of_prompts_prefills_in_one_step_under_budget():
    sched = make_scheduler(max_num_batched_tokens=64)
    lengths = {"a": 5, "b": 7, "c": 9}
    for rid, n in lengths.items():
        sched.add_request(make_request(rid, n))
    out = sched.schedule()
    assert ids(out) == ["a", "b", "c"]
    assert [row.num_new_tokens for row in out.scheduled] == [5, 7, 9]
    assert [row.start for row in out.scheduled] == [0, 0, 0]
    assert all(row.samples for row in out.scheduled)
    assert out.num_batched_tokens == 21
    assert sched.num_running == 3 and sched.num_waiting == 0
    updates = sched.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids={rid: [1] for rid in lengths})
    )
    assert [u.request_id for u in updates] == ["a", "b", "c"]
    assert all(u.new_token_ids == [1] for u in updates)
    for rid, n in lengths.items():
        assert sched.requests[rid].num_computed_tokens == n


def test_long_prompt_is_chunked_and_samples_only_on_final_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    request = make_request("long", 25, max_tokens=2)
    sched.add_request(request)
    driver = Driver(sched)
    chunks, starts, samples, updates_per_step = [], [], [], []
    while request.num_output_tokens == 0:
        out = driver.schedule()
        assert out.num_batched_tokens <= 8
        (row,) = out.scheduled
        chunks.append(row.num_new_tokens)
        starts.append(row.start)
        samples.append(row.samples)
        updates_per_step.append(driver.update(out))
    assert chunks == [8, 8, 8, 1]
    assert starts == [0, 8, 16, 24]
    assert samples == [False, False, False, True]
    assert [len(u) for u in updates_per_step] == [0, 0, 0, 1]
    assert request.output_token_ids == [1003]
    assert request.num_computed_tokens == 25


def test_decode_rows_schedule_one_token_each():
    sched = make_scheduler()
    for rid in "abc":
        sched.add_request(make_request(rid, 6, max_tokens=5))
    driver = Driver(sched)
    driver.step()  # prefill
    for _ in range(3):
        out = driver.schedule()
        assert ids(out) == ["a", "b", "c"]
        assert all(row.num_new_tokens == 1 for row in out.scheduled)
        assert all(row.samples for row in out.scheduled)
        assert all(row.start == row.request.num_tokens - 1 for row in out.scheduled)
        driver.update(out)


def test_prefill_chunk_shares_budget_with_running_decodes():
    sched = make_scheduler(max_num_batched_tokens=10)
    driver = Driver(sched)
    sched.add_request(make_request("a", 3, max_tokens=10))
    sched.add_request(make_request("b", 3, max_tokens=10))
    driver.step()
    sched.add_request(make_request("long", 30, max_tokens=1))
    out = driver.schedule()
    assert ids(out) == ["a", "b", "long"]  # running requests first
    assert [row.num_new_tokens for row in out.scheduled] == [1, 1, 8]
    assert out.num_batched_tokens == 10
    assert not out.scheduled[2].samples
    driver.update(out)


def test_scheduled_block_tables_cover_every_scheduled_position():
    sched = make_scheduler(max_num_batched_tokens=16)
    for rid, n in (("a", 13), ("b", 30), ("c", 2)):
        sched.add_request(make_request(rid, n, max_tokens=7))

    def check(out):
        for row in out.scheduled:
            assert len(row.block_ids) * BS >= row.end
            assert len(set(row.block_ids)) == len(row.block_ids)

    Driver(sched).run(check=check)
    assert sched.block_manager.all_blocks_free()


# ---- admission limits and order ------------------------------------------------------------


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=3))
    driver = Driver(sched)
    out = driver.schedule()
    assert ids(out) == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "r4"]

    def check(out):
        assert len(out.scheduled) <= 2
        assert sched.num_running <= 2

    driver.update(out)
    driver.run(check=check)
    assert sched.block_manager.all_blocks_free()


def test_requests_are_admitted_first_come_first_served():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    order = ["r0", "r1", "r2", "r3", "r4"]
    max_tokens = {"r0": 6, "r1": 2, "r2": 1, "r3": 4, "r4": 1}
    for rid in order:
        sched.add_request(make_request(rid, 5, max_tokens=max_tokens[rid]))
    first_seen: dict[str, int] = {}

    def check(out):
        for rid in ids(out):
            first_seen.setdefault(rid, len(first_seen))

    Driver(sched).run(check=check)
    assert sorted(first_seen, key=first_seen.get) == order


def test_head_of_line_request_is_chunked_to_the_remaining_budget_not_skipped():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 9))
    sched.add_request(make_request("c", 2))
    out = sched.schedule()
    assert ids(out) == ["a", "b"]
    assert [row.num_new_tokens for row in out.scheduled] == [6, 4]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_waiting_head_that_does_not_fit_in_kv_blocks_the_requests_behind_it():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 5, max_tokens=3))  # 2 blocks
    sched.add_request(make_request("b", 12, max_tokens=1))  # 3 blocks: does not fit yet
    sched.add_request(make_request("c", 2, max_tokens=1))  # would fit, must not jump ahead
    driver = Driver(sched)
    out = driver.schedule()
    assert ids(out) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    driver.update(out)
    first_seen: dict[str, int] = {"a": 0}

    def check(out):
        for rid in ids(out):
            first_seen.setdefault(rid, len(first_seen))

    driver.run(check=check)
    assert sorted(first_seen, key=first_seen.get) == ["a", "b", "c"]
    assert sched.block_manager.all_blocks_free()


# ---- preemption ----------------------------------------------------------------------------


def test_preemption_sends_latest_request_to_front_of_waiting_with_zero_computed():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    reqs = {rid: make_request(rid, n, max_tokens=4) for rid, n in (("a", 7), ("b", 7), ("c", 3))}
    for request in reqs.values():
        sched.add_request(request)
    driver = Driver(sched)
    assert ids(driver.step()[0]) == ["a", "b"]  # 2 + 2 blocks, cache full
    assert ids(driver.step()[0]) == ["a", "b"]  # 8 tokens each still fit in 2 blocks
    assert sched.num_preemptions == 0

    out = driver.schedule()  # a needs a 3rd block: b (the latest admitted) is preempted
    assert sched.num_preemptions == 1
    assert ids(out) == ["a"]
    b = reqs["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.output_token_ids == [1000, 1001]  # generated tokens are kept
    assert sched.block_manager.block_ids("b") == []
    assert [r.request_id for r in sched.running] == ["a"]
    driver.update(out)

    readmitted = {}

    def check(out):
        for row in out.scheduled:
            if row.request is b and "b" not in readmitted:
                readmitted["b"] = (row.start, row.num_new_tokens, ids(out))

    driver.run(check=check)
    start, num_new, _ = readmitted["b"]
    assert start + num_new == 9  # recomputes prompt + both kept outputs, then samples
    for request in reqs.values():
        assert request.num_output_tokens == 4
        assert request.finish_reason == "length"
    assert b.output_token_ids[:2] == [1000, 1001]
    assert sched.block_manager.all_blocks_free()


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tiny_cache_preempts_yet_every_request_finishes_with_exactly_max_tokens(
    enable_prefix_caching,
):
    sched = make_scheduler(
        num_blocks=8,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        enable_prefix_caching=enable_prefix_caching,
    )
    shared = list(range(8))
    specs = [
        ("r0", shared + [40, 41], 9),
        ("r1", shared + [50], 12),
        ("r2", 6, 10),
        ("r3", shared + [60, 61, 62], 7),
        ("r4", 3, 12),
        ("r5", 11, 5),
    ]
    requests = {}
    for rid, prompt, max_tokens in specs:
        requests[rid] = make_request(rid, prompt, max_tokens=max_tokens)
        sched.add_request(requests[rid])
    driver = Driver(sched)
    emitted: dict[str, list[int]] = {rid: [] for rid in requests}
    bm = sched.block_manager

    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "scheduler made no progress"
        out = driver.schedule()
        assert out.num_batched_tokens <= 12
        assert sched.num_running <= 6
        owners: dict[int, int] = {}
        for row in out.scheduled:
            assert row.num_new_tokens >= 1
            assert len(row.block_ids) * BS >= row.end
            for block_id in row.block_ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id, count in owners.items():
            assert bm.blocks[block_id].ref_count >= count
            if count > 1:  # only prefix-cached blocks are shared
                assert bm.blocks[block_id].block_hash is not None
        runner_output = driver.fake_output(out)
        for rid, tokens in runner_output.sampled_token_ids.items():
            emitted[rid].extend(tokens)
        driver.step_no += 1
        sched.update_from_output(out, runner_output)

    assert sched.num_preemptions > 0
    for rid, _, max_tokens in specs:
        request = requests[rid]
        assert request.num_output_tokens == max_tokens, rid
        assert request.output_token_ids == emitted[rid], rid
        assert request.finish_reason == "length"
    assert bm.all_blocks_free()
    assert not sched.requests


# ---- stop conditions -----------------------------------------------------------------------


def run_with_tokens(request: Request, script: list[list[int]], **sched_kwargs) -> Scheduler:
    """Run one request, feeding it ``script[i]`` at its i-th sampling step."""
    sched = make_scheduler(**sched_kwargs)
    sched.add_request(request)
    driver = Driver(sched)
    i = 0
    while sched.has_unfinished_requests():
        assert i < len(script), "request did not finish within the script"
        out = driver.schedule()
        if any(row.samples for row in out.scheduled):
            driver.update(out, {request.request_id: script[i]})
            i += 1
        else:
            driver.update(out)
    return sched


def test_eos_finishes_with_stop_and_eos_as_stop_reason():
    request = make_request("a", 5, max_tokens=10, eos_token_ids=frozenset({7}))
    sched = run_with_tokens(request, [[5], [6], [7], [8]])
    assert request.output_token_ids == [5, 6, 7]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 7
    assert sched.block_manager.all_blocks_free()


def test_eos_update_carries_finish_and_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, eos_token_ids=frozenset({7})))
    driver = Driver(sched)
    _, updates = driver.step({"a": [7]})
    (update,) = updates
    assert update.new_token_ids == [7]
    assert update.finish_reason == "stop"
    assert update.stop_reason == 7


def test_ignore_eos_generates_until_max_tokens():
    request = make_request("a", 5, max_tokens=4, ignore_eos=True, eos_token_ids=frozenset({7}))
    run_with_tokens(request, [[7]] * 10)
    assert request.output_token_ids == [7, 7, 7, 7]
    assert request.finish_reason == "length"
    assert request.stop_reason is None


def test_stop_token_ids_still_apply_with_ignore_eos():
    request = make_request(
        "a", 5, max_tokens=10, ignore_eos=True, eos_token_ids=frozenset({7}), stop_token_ids=[9]
    )
    run_with_tokens(request, [[7], [9], [1]])
    assert request.output_token_ids == [7, 9]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 9


def test_min_tokens_suppresses_eos_until_reached():
    request = make_request("a", 5, max_tokens=10, min_tokens=3, eos_token_ids=frozenset({7}))
    run_with_tokens(request, [[7]] * 10)
    assert request.output_token_ids == [7, 7, 7]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 7


def test_min_tokens_suppresses_stop_token_ids_until_reached():
    request = make_request("a", 5, max_tokens=10, min_tokens=2, stop_token_ids=[9])
    run_with_tokens(request, [[9], [9], [9]])
    assert request.output_token_ids == [9, 9]
    assert request.finish_reason == "stop"


def test_stop_token_ids_finish_with_the_token_as_stop_reason():
    request = make_request("a", 5, max_tokens=10, stop_token_ids=[11, 12])
    sched = run_with_tokens(request, [[3], [12], [4]])
    assert request.output_token_ids == [3, 12]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 12
    assert sched.block_manager.all_blocks_free()


def test_max_tokens_finishes_with_length():
    request = make_request("a", 5, max_tokens=3)
    sched = run_with_tokens(request, [[1], [2], [3], [4]])
    assert request.output_token_ids == [1, 2, 3]
    assert request.finish_reason == "length"
    assert request.stop_reason is None
    assert sched.block_manager.all_blocks_free()


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_max_model_len_caps_request_with_length(max_tokens):
    request = make_request("a", 6, max_tokens=max_tokens)
    sched = run_with_tokens(request, [[1]] * 20, max_model_len=10)
    assert request.num_output_tokens == 4
    assert request.num_tokens == 10
    assert request.finish_reason == "length"
    assert sched.block_manager.all_blocks_free()


def test_stop_inside_a_multi_token_step_drops_the_later_tokens():
    request = make_request("a", 5, max_tokens=10, eos_token_ids=frozenset({7}))
    sched = make_scheduler()
    sched.add_request(request)
    _, updates = Driver(sched).step({"a": [5, 7, 6]})
    assert request.output_token_ids == [5, 7]
    assert updates[0].new_token_ids == [5, 7]
    assert request.finish_reason == "stop"


def test_max_tokens_truncates_a_multi_token_step():
    request = make_request("a", 5, max_tokens=2)
    sched = make_scheduler()
    sched.add_request(request)
    Driver(sched).step({"a": [1, 2, 3]})
    assert request.output_token_ids == [1, 2]
    assert request.finish_reason == "length"


# ---- abort, finish, finished ids -----------------------------------------------------------


def test_abort_waiting_request_removes_it_and_reports_it_once():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 5, max_tokens=5))
    sched.add_request(make_request("b", 5, max_tokens=5))
    driver = Driver(sched)
    driver.step()
    aborted = sched.abort_request("b")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert sched.num_waiting == 0
    out = driver.schedule()
    assert out.finished_request_ids == ["b"]
    assert ids(out) == ["a"]
    driver.update(out)
    assert driver.schedule().finished_request_ids == []


def test_abort_running_request_frees_blocks_and_its_inflight_step_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=5))
    sched.add_request(make_request("b", 6, max_tokens=5))
    driver = Driver(sched)
    driver.step()
    out = driver.schedule()
    assert ids(out) == ["a", "b"]
    b = sched.requests["b"]
    computed = b.num_computed_tokens
    outputs = list(b.output_token_ids)

    assert sched.abort_request("b") is b  # while the step "runs"
    assert sched.block_manager.block_ids("b") == []
    assert [r.request_id for r in sched.running] == ["a"]
    updates = driver.update(out)
    assert [u.request_id for u in updates] == ["a"]
    assert b.num_computed_tokens == computed
    assert b.output_token_ids == outputs
    assert b.finish_reason == "abort"

    out = driver.schedule()
    assert out.finished_request_ids == ["b"]
    assert ids(out) == ["a"]
    driver.update(out)
    assert "b" not in driver.schedule().finished_request_ids


def test_abort_during_chunked_prefill_frees_every_block():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 30))
    driver = Driver(sched)
    driver.step()
    assert sched.block_manager.block_ids("a")
    sched.abort_request("a")
    assert sched.block_manager.all_blocks_free()
    assert not sched.has_unfinished_requests()


def test_abort_of_unknown_or_finished_id_returns_none():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    Driver(sched).run()
    assert sched.schedule().finished_request_ids == ["a"]
    assert sched.abort_request("a") is None
    assert sched.abort_request("nope") is None
    assert sched.schedule().finished_request_ids == []


def test_finish_request_from_outside_frees_blocks_with_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, max_tokens=10))
    sched.add_request(make_request("b", 6, max_tokens=10))
    driver = Driver(sched)
    driver.step()
    a = sched.requests["a"]
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "</s>")
    assert a.finish_reason == "stop"
    assert a.stop_reason == "</s>"
    assert sched.block_manager.block_ids("a") == []
    assert [r.request_id for r in sched.running] == ["b"]
    out = driver.schedule()
    assert out.finished_request_ids == ["a"]
    assert ids(out) == ["b"]
    sched.finish_request("b", RequestStatus.FINISHED_STOPPED, "x")
    driver.update(out)  # b's in-flight step is ignored
    assert sched.requests == {}
    assert sched.block_manager.all_blocks_free()


def test_finished_ids_appear_exactly_once_in_the_next_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    sched.add_request(make_request("b", 5, max_tokens=3))
    driver = Driver(sched)
    out, updates = driver.step()
    assert out.finished_request_ids == []
    assert {u.request_id: u.finish_reason for u in updates} == {"a": "length", "b": None}
    seen = []
    for _ in range(4):
        out, _ = driver.step()
        seen.extend(out.finished_request_ids)
    seen.extend(driver.schedule().finished_request_ids)
    assert seen == ["a", "b"]


def test_duplicate_request_id_raises_value_error():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 3))  # while waiting
    Driver(sched).step()
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 3))  # while running
    assert sched.num_running == 1 and sched.num_waiting == 0


# ---- prefix cache through the scheduler ----------------------------------------------------


def test_prefix_cache_hit_skips_cached_prompt_tokens():
    sched = make_scheduler()
    prompt = list(range(10))
    sched.add_request(make_request("a", prompt, max_tokens=3))
    driver = Driver(sched)
    driver.run()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out = driver.schedule()
    (row,) = out.scheduled
    assert (row.start, row.num_new_tokens, row.samples) == (8, 2, True)
    (update,) = driver.update(out)
    assert update.num_cached_tokens == 8
    assert sched.block_manager.all_blocks_free()


def test_blocks_filled_in_a_requests_final_step_are_prefix_cached():
    # A request that finishes in the step that fills its blocks (here a prefill-only
    # max_tokens=1 request) should leave those blocks in the prefix cache.
    sched = make_scheduler()
    prompt = list(range(9))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    driver = Driver(sched)
    driver.run()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    (row,) = driver.schedule().scheduled
    assert row.start == 8, (
        "the 2 full blocks computed in a's last step were never cached: "
        "update_from_output frees the finished request before cache_full_blocks"
    )


def test_block_manager_keeps_no_state_for_finished_requests():
    sched = make_scheduler()
    for rid in "abc":
        sched.add_request(make_request(rid, 9, max_tokens=2))
    Driver(sched).run()
    assert sched.block_manager.all_blocks_free()
    assert sched.block_manager._req_hashes == {}, (
        "cache_full_blocks re-creates a _req_hashes entry for requests already freed"
    )
