"""``tandem bench serve`` against a tiny in-process OpenAI-compatible SSE server (no model)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.bench import serving
from tandem.bench.datasets import BenchRequest
from tandem.bench.serving import ServeConfig, arrival_offsets, run_benchmark
from tandem.bench.serving_report import RequestRecord, compute_metrics, latency_stats, tpot

CHUNK_SLEEP = 0.01


def _fake_app(state: dict[str, Any]) -> FastAPI:
    """Streams one character per requested token; the prompt text picks odd behaviour:
    ``fail`` answers 500, ``slow`` stalls, ``nousage`` leaves out the usage chunk and
    ``empty`` streams no text (as if the first token were EOS)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        prompt = prompt if isinstance(prompt, str) else ""
        if "fail" in prompt:
            return JSONResponse({"error": {"message": "boom", "code": 500}}, status_code=500)
        n = body["max_tokens"]

        def event(text: str | None, finish: str | None = None, usage: dict | None = None) -> str:
            if text is None:
                choices = []
            elif chat:
                choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": text, "finish_reason": finish}]
            return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n"

        async def stream() -> Any:
            state["active"] += 1
            state["max_active"] = max(state["max_active"], state["active"])
            try:
                if "slow" in prompt:
                    await asyncio.sleep(2.0)
                if chat:
                    yield event("")  # the role chunk: no text, so not a token
                for _ in range(0 if "empty" in prompt else n):
                    await asyncio.sleep(CHUNK_SLEEP)
                    yield event("x")
                yield event("", finish="length")
                if "nousage" not in prompt:
                    usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                    yield event(None, usage=usage)
                yield "data: [DONE]\n\n"
            finally:
                state["active"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, dict[str, Any]]]:
    """The fake server's base URL and its state (received bodies, peak concurrency)."""
    state: dict[str, Any] = {"bodies": [], "active": 0, "max_active": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_fake_app(state), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.01)
    assert srv.started, "the fake server did not start"
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fresh(server) -> tuple[str, dict[str, Any]]:
    """The server with its recorded state cleared."""
    base, state = server
    state.update(bodies=[], active=0, max_active=0)
    return base, state


def _config(
    base: str, tmp_path, prompts: list[str | list[int]], output_len: int = 4, **kwargs: Any
) -> ServeConfig:
    reqs = [BenchRequest(p, 3, output_len) for p in prompts]
    return ServeConfig(
        base_url=base,
        requests=reqs,
        num_prompts=len(reqs),
        dataset="random",
        out_dir=str(tmp_path),
        disable_tqdm=True,
        **kwargs,
    )


def test_latency_stats_known_values():
    stats = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean_ms"] == pytest.approx(50.5)
    assert stats["p50_ms"] == pytest.approx(50.5)
    assert stats["p90_ms"] == pytest.approx(90.1)
    assert stats["p99_ms"] == pytest.approx(99.01)
    assert latency_stats([]) == {"mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}


def test_tpot_and_compute_metrics():
    a = RequestRecord(10, 5, success=True, ttft=0.1, e2e=0.5, itl=[0.1] * 4, output_tokens=5)
    b = RequestRecord(
        20, 3, success=True, ttft=0.3, e2e=0.5, itl=[0.2], output_tokens=2, prompt_tokens=25
    )
    one = RequestRecord(4, 1, success=True, ttft=0.2, e2e=0.2, output_tokens=1)
    failed = RequestRecord(99, 9, error="HTTP 500")
    assert tpot(a) == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert tpot(b) == pytest.approx(0.2)
    assert tpot(one) is None and tpot(failed) is None
    m = compute_metrics([a, b, one, failed], duration_s=2.0)
    assert (m["successful_requests"], m["failed_requests"]) == (3, 1)
    assert m["total_input_tokens"] == 10 + 25 + 4  # usage's prompt_tokens wins when given
    assert m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(47 / 2)
    assert m["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert m["tpot"]["mean_ms"] == pytest.approx(150.0)
    assert m["itl"]["p50_ms"] == pytest.approx(100.0)
    assert m["e2e"]["p50_ms"] == pytest.approx(500.0)


def test_arrival_offsets_are_seeded_poisson():
    a = arrival_offsets(2000, rate=10.0, seed=3)
    assert a == arrival_offsets(2000, rate=10.0, seed=3)
    assert a != arrival_offsets(2000, rate=10.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(5, rate=math.inf, seed=0) == [0.0] * 5
    assert arrival_offsets(1, rate=2.0, seed=0) == [0.0]


def test_run_sends_and_counts_every_request(fresh, tmp_path):
    base, state = fresh
    prompts: list[str | list[int]] = [f"hello {i}" for i in range(7)] + [[1, 2, 3]]
    result = asyncio.run(run_benchmark(_config(base, tmp_path, prompts, ignore_eos=True)))
    m = result["metrics"]
    assert (m["successful_requests"], m["failed_requests"]) == (8, 0)
    assert len(state["bodies"]) == 8
    body = state["bodies"][0]
    assert body["model"] == "fake-model"  # discovered from /v1/models
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert [1, 2, 3] in [b["prompt"] for b in state["bodies"]]
    assert m["total_output_tokens"] == 32 and m["total_input_tokens"] == 8 * 7
    for rec in result["records"]:
        assert rec["success"] and rec["output_tokens"] == 4 and len(rec["itl"]) == 3
        assert 0 < rec["ttft"] < rec["e2e"]
    assert m["itl"]["p50_ms"] >= CHUNK_SLEEP * 1000 * 0.8
    assert m["tpot"]["mean_ms"] >= CHUNK_SLEEP * 1000 * 0.8

    assert os.path.basename(result["output_path"]).startswith("serve-random-")
    with open(result["output_path"], encoding="utf-8") as f:
        saved = json.load(f)
    assert set(saved) >= {"config", "machine", "metrics", "records"}
    assert saved["config"]["model"] == "fake-model" and len(saved["records"]) == 8
    with open(result["plot_path"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_failures_are_counted_not_fatal(fresh, tmp_path):
    base, _ = fresh
    prompts = ["ok", "fail", "slow", "empty"]
    config = _config(base, tmp_path, prompts, model="m", timeout_s=0.5, label="fails")
    result = asyncio.run(run_benchmark(config))
    m = result["metrics"]
    assert (m["successful_requests"], m["failed_requests"]) == (2, 2)
    errors = [r["error"] for r in result["records"]]
    assert errors[0] == "" and errors[1].startswith("HTTP 500") and "Timeout" in errors[2]
    empty = result["records"][3]  # a reply with no text is not a failure, but has no TTFT
    assert empty["success"] and empty["ttft"] is None and empty["output_tokens"] == 4
    assert m["ttft"]["p50_ms"] > 0
    assert os.path.basename(result["output_path"]).startswith("serve-fails-")


def test_unreachable_server_fails_requests(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    config = _config(f"http://127.0.0.1:{port}", tmp_path, ["a", "b"], model="m", save=False)
    m = asyncio.run(run_benchmark(config))["metrics"]
    assert (m["successful_requests"], m["failed_requests"]) == (0, 2)


def test_poisson_send_times_follow_the_seeded_schedule(fresh, tmp_path):
    base, _ = fresh
    config = _config(base, tmp_path, ["p"] * 6, output_len=2, request_rate=20.0, seed=5, save=False)
    result = asyncio.run(run_benchmark(config))
    expected = arrival_offsets(6, 20.0, 5)
    sent = [r["send_s"] for r in result["records"]]
    assert sent == pytest.approx(expected, abs=0.05)


def test_max_concurrency_limits_requests_in_flight(fresh, tmp_path):
    base, state = fresh
    config = _config(base, tmp_path, ["p"] * 6, output_len=3, max_concurrency=2, save=False)
    result = asyncio.run(run_benchmark(config))
    assert result["metrics"]["successful_requests"] == 6
    assert state["max_active"] == 2


def test_chat_endpoint_counts_chunks_without_usage(fresh, tmp_path):
    base, state = fresh
    config = _config(base, tmp_path, ["nousage please"], output_len=5, endpoint="chat", save=False)
    result = asyncio.run(run_benchmark(config))
    rec = result["records"][0]
    assert rec["success"] and rec["output_tokens"] == 5 and rec["prompt_tokens"] is None
    body = state["bodies"][0]
    assert body["messages"] == [{"role": "user", "content": "nousage please"}]
    assert body["max_completion_tokens"] == 5 and "ignore_eos" not in body


def test_cli_defaults_and_main(fresh, tmp_path, monkeypatch):
    base, _ = fresh
    parser = argparse.ArgumentParser()
    serving.add_cli_arguments(parser)
    defaults = parser.parse_args([])
    assert defaults.request_rate == math.inf and defaults.max_concurrency is None
    assert (defaults.endpoint, defaults.dataset, defaults.num_prompts) == (
        "completions",
        "sharegpt",
        100,
    )
    assert defaults.out_dir == os.path.join("benchmarks", "results")
    args = parser.parse_args(
        [
            "--base-url",
            f"{base}/v1",
            "--dataset",
            "random",
            "--num-prompts",
            "3",
            "--out-dir",
            str(tmp_path),
            "--request-rate",
            "50",
            "--label",
            "cli run",
        ]
    )
    monkeypatch.setattr(
        serving, "build_requests", lambda config: [BenchRequest("hi", 1, 2)] * config.num_prompts
    )
    assert serving.main_from_args(args) == 0
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0].startswith("serve-cli_run-")
    assert {os.path.splitext(n)[1] for n in names} == {".json", ".png"}
