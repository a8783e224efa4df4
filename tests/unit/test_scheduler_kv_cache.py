"""Scheduler and KV cache: preemption by recompute when the blocks run out (the latest
admitted request goes back to the front of the queue, and every request still finishes), and
prefix-cache hits through the scheduler. Driven with fake ModelRunnerOutput objects
(``scheduler_driver.py``): every row that samples gets token ``1000 + step`` unless a test
says otherwise."""

from __future__ import annotations

import pytest
from scheduler_driver import BS, Driver, ids, make_request, make_scheduler

from tandem.request import RequestStatus

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
