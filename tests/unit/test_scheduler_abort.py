"""Scheduler: abort and finish from outside (waiting, running with a step in flight, during
chunked prefill), finished request ids reported once, duplicate request ids. Driven with fake
ModelRunnerOutput objects (``scheduler_driver.py``): every row that samples gets token
``1000 + step``."""

from __future__ import annotations

import pytest
from scheduler_driver import Driver, ids, make_request, make_scheduler

from tandem.request import RequestStatus

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
