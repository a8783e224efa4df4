"""Scheduler: batching under the token budget, chunked prefill, max_num_seqs and
first-come-first-served admission. Driven with fake ModelRunnerOutput objects
(``scheduler_driver.py``): every row that samples gets token ``1000 + step`` unless a test
says otherwise."""

from __future__ import annotations

from scheduler_driver import BS, Driver, ids, make_request, make_scheduler

from tandem.step import ModelRunnerOutput

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


def test_rows_made_while_a_sampling_step_is_in_flight_are_follow_ups():
    """Overlap scheduling: the next chunk of a prompt whose chunk in flight samples nothing
    is an ordinary row (its start is certain); a row made while a step of its request that
    samples is in flight is a follow-up (its start is the runner's to know)."""
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("long", 12, max_tokens=4))
    first = sched.schedule()  # chunk 0-8: samples nothing
    second = sched.schedule()  # chunk 8-12, scheduled before the first is read: samples
    third = sched.schedule()  # the decode row after it, still unread
    rows = [out.scheduled[0] for out in (first, second, third)]
    assert [(row.start, row.num_new_tokens, row.samples) for row in rows[:2]] == [
        (0, 8, False),
        (8, 4, True),
    ]
    assert [row.follow_up for row in rows] == [False, False, True]


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
