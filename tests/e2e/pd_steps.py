"""Driving engine cores by hand in PD tests: step them until requests finish, submit requests
(to a decode core with the prefill core's address), compare what two cores reported, let
them settle, check that nothing is left held."""

from __future__ import annotations

import time

from tandem.core.engine_core import EngineCore
from tandem.request import Request

LOGPROB_TOLERANCE = 1e-4


def run(
    engines: list[EngineCore], watch: EngineCore, ids: set[str], deadline_s: float = 120.0
) -> dict[str, dict]:
    """Step every engine until ``watch`` has finished ``ids``; the updates it reported."""
    results = {
        i: {
            "tokens": [],
            "logprobs": [],
            "prompt_logprobs": [],
            "finish": None,
            "stop": None,
            "error": None,
        }
        for i in ids
    }
    start = time.monotonic()
    while any(r["finish"] is None for r in results.values()):
        assert time.monotonic() - start < deadline_s, "requests did not finish in time"
        for engine in engines:
            updates = engine.step()
            if engine is not watch:
                continue
            for update in updates:
                result = results.get(update.request_id)
                if result is None:
                    continue
                result["tokens"] += update.new_token_ids
                result["logprobs"] += update.new_logprobs
                result["prompt_logprobs"] += update.new_prompt_logprobs
                if update.finish_reason is not None:
                    result.update(
                        finish=update.finish_reason, stop=update.stop_reason, error=update.error
                    )
    return results


def settle(engines: list[EngineCore], seconds: float = 0.0) -> None:
    """Step until no engine has work left (held blocks released)."""
    end = time.monotonic() + 60 + seconds
    while any(e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < end, "engines did not settle"
        for engine in engines:
            engine.step()


def assert_no_leak(*engines: EngineCore) -> None:
    for engine in engines:
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.num_blocks, engine.config.disagg
        assert not engine.scheduler.held


def submit(engine: EngineCore, ids: list[str], prompts, params, remote: str | None):
    for request_id, prompt, param in zip(ids, prompts, params, strict=True):
        request = Request(request_id, list(prompt), param)
        request.remote_prefill = remote
        engine.add_request(request)


def compare(got: dict, want: dict) -> None:
    for request_id, w in want.items():
        g = got[request_id]
        assert g["tokens"] == w["tokens"], request_id
        assert (g["finish"], g["stop"], g["error"]) == (w["finish"], w["stop"], None)
        for kind in ("logprobs", "prompt_logprobs"):
            assert len(g[kind]) == len(w[kind])
            for (gt, glp, grank, gtop), (wt, wlp, wrank, wtop) in zip(
                g[kind], w[kind], strict=True
            ):
                assert (gt, grank) == (wt, wrank)
                assert abs(glp - wlp) <= LOGPROB_TOLERANCE
                assert [t for t, _ in gtop] == [t for t, _ in wtop]
