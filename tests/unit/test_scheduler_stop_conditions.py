"""Scheduler: stop conditions (EOS, stop token ids, ignore_eos, min_tokens, max_tokens,
max_model_len), also inside a step that emits several tokens. Driven with fake
ModelRunnerOutput objects (``scheduler_driver.py``) whose tokens each test scripts."""

from __future__ import annotations

import pytest
from scheduler_driver import Driver, make_request, make_scheduler

from tandem.core.scheduler import Scheduler
from tandem.request import Request

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
