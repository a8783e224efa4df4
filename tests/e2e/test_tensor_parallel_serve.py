"""Serving with tensor parallelism: the client that ``tandem serve`` uses starts one engine-core
process per rank (two gloo ranks on the CPU, dummy:tiny); rank 0 forwards every message to
rank 1 each turn. Concurrent streams give what one in-process engine gives (greedy tokens
under the tie rule, logprobs within 1e-4); aborts and stop strings reach both ranks (the
ranks would otherwise fall out of step and hang in a collective); a dead rank ends the
requests in flight with an error instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from tandem import SamplingParams
from tandem.bench.hf_reference import reference_from_output, tie_rule_mismatches
from tandem.llm import engine_config
from tandem.server.engine_client import AsyncEngineClient, EngineDeadError, RequestFailed

pytestmark = pytest.mark.slow  # tensor-parallel engine ranks in spawned processes

COMMON = {"model": "dummy:tiny", "dtype": "float32", "num_kv_blocks": 64}
TOLERANCE = 1e-4
TIMEOUT_S = 120


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(8)
    return torch.randint(0, 512, (8, 16), generator=generator).tolist()


def _greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(temperature=0.0, logprobs=2, **kwargs)


async def _collect(
    client: AsyncEngineClient,
    prompt: list[int],
    params: SamplingParams,
    max_outputs: int | None = None,
) -> SimpleNamespace:
    """The request's outputs summed up (stops reading after ``max_outputs`` deltas, which
    aborts the request)."""
    tokens, logprobs, text, finish = [], [], "", None
    async for index, output in _enumerate(client.generate(None, prompt, params)):
        completion = output.outputs[0]
        tokens += completion.token_ids
        logprobs += completion.logprobs or []
        text += completion.text
        finish = completion.finish_reason
        if max_outputs is not None and index + 1 >= max_outputs:
            break
    completion = SimpleNamespace(
        token_ids=tokens, logprobs=logprobs, text=text, finish_reason=finish
    )
    return SimpleNamespace(outputs=[completion])


async def _enumerate(stream):
    index = 0
    async for item in stream:
        yield index, item
        index += 1


async def _idle(client: AsyncEngineClient) -> dict:
    """The leader's stats once it reports every KV block free (or after 20 s)."""
    for _ in range(200):
        stats = client.stats
        if (
            stats.get("num_free_kv_blocks") == client.info.num_kv_blocks
            and stats.get("num_running") == 0
            and stats.get("num_waiting") == 0
        ):
            break
        await asyncio.sleep(0.1)
    return client.stats


@pytest.fixture(scope="module")
def tp_client():
    """A started two-rank client, shared by the module (an event loop of its own)."""
    loop = asyncio.new_event_loop()
    client = AsyncEngineClient(engine_config(tensor_parallel_size=2, **COMMON))
    loop.run_until_complete(asyncio.wait_for(client.start(), TIMEOUT_S))
    yield loop, client
    if client._processes[0].is_alive():
        loop.run_until_complete(client.shutdown())
    loop.close()


def test_two_ranks_serve_what_one_engine_generates(make_llm, tp_client):
    loop, client = tp_client

    async def run():
        return await asyncio.gather(*(_collect(client, p, _greedy()) for p in _prompts()))

    outputs = loop.run_until_complete(asyncio.wait_for(run(), TIMEOUT_S))
    baseline = make_llm(**COMMON).generate([{"prompt_token_ids": p} for p in _prompts()], _greedy())
    references = [reference_from_output(o.outputs[0]) for o in baseline]
    problems, _ = tie_rule_mismatches(outputs, references, TOLERANCE)
    assert not problems, problems
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)


def test_aborts_and_stop_strings_keep_the_ranks_in_step(make_llm, tp_client):
    loop, client = tp_client
    prompts = _prompts()
    baseline = make_llm(**COMMON).generate([{"prompt_token_ids": prompts[0]}], _greedy())
    stop = baseline[0].outputs[0].text[3:6]
    assert stop.strip(), "the baseline text is too short for a stop string"

    async def run():
        aborted = [_collect(client, p, _greedy(), max_outputs=2) for p in prompts[1:5]]
        stopped = _collect(client, prompts[0], _greedy(stop=[stop]))
        *_, with_stop = await asyncio.gather(*aborted, stopped)
        # Afterwards the ranks must still agree: a whole request completes as one engine's.
        return with_stop, await _collect(client, prompts[5], _greedy())

    with_stop, after = loop.run_until_complete(asyncio.wait_for(run(), TIMEOUT_S))
    assert with_stop.outputs[0].finish_reason == "stop"
    assert stop not in with_stop.outputs[0].text
    expected = make_llm(**COMMON).generate([{"prompt_token_ids": prompts[5]}], _greedy())
    problems, _ = tie_rule_mismatches(
        [after], [reference_from_output(expected[0].outputs[0])], TOLERANCE
    )
    assert not problems, problems
    stats = loop.run_until_complete(_idle(client))
    assert stats.get("num_free_kv_blocks") == client.info.num_kv_blocks, stats
    assert stats.get("num_running") == 0 and stats.get("num_waiting") == 0, stats


def test_invariant_no_hang_a_dead_rank_fails_requests_instead_of_hanging(tp_client):
    loop, client = tp_client

    async def run():
        task = asyncio.ensure_future(
            _collect(client, _prompts()[0], _greedy(ignore_eos=True, max_tokens=400))
        )
        await asyncio.sleep(0.5)
        os.kill(client._processes[1].pid, signal.SIGKILL)
        return await task

    # The request fails: the leader's collective breaks (the core fails the batch), or the
    # client finds the rank gone first; either way the client is dead soon after, naming it.
    with pytest.raises((EngineDeadError, RequestFailed)):
        loop.run_until_complete(asyncio.wait_for(run(), TIMEOUT_S))

    async def until_dead():
        while client.dead is None:
            await asyncio.sleep(0.1)

    loop.run_until_complete(asyncio.wait_for(until_dead(), 10))
    assert "rank1 exited" in client.dead
    loop.run_until_complete(client.shutdown())
    assert not any(process.is_alive() for process in client._processes)
