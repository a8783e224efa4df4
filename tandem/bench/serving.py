"""Online serving benchmark against any OpenAI-compatible server (Tandem, vLLM, SGLang...).

Requests are sent with Poisson arrivals (or all at once), each streamed over server-sent
events, and the client measures time to first token (TTFT), time per output token (TPOT),
inter-token latency (ITL) and end-to-end latency, as vLLM's ``benchmark_serving.py`` does.
Results go to ``out_dir/serve-<label or dataset>-<timestamp>.json`` with a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import asdict, dataclass, fields
from itertools import accumulate
from typing import Any

import httpx

from tandem.bench.datasets import BenchRequest, load_sharegpt, random_requests
from tandem.bench.serving_report import RequestRecord, compute_metrics, format_table, save_result

DATASETS = ("sharegpt", "random")
ENDPOINTS = ("completions", "chat")


@dataclass
class ServeConfig:
    """Settings of one serving benchmark; ``requests`` and ``transport`` are for tests."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    dataset: str = "sharegpt"
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    max_output_len: int = 128
    max_prompt_len: int = 512
    random_input_len: int | None = None
    random_output_len: int | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = False
    tokenizer: str | None = None
    out_dir: str = os.path.join("benchmarks", "results")
    label: str | None = None
    timeout_s: float = 600.0
    disable_tqdm: bool = False
    save: bool = True
    requests: list[BenchRequest] | None = None
    transport: httpx.AsyncBaseTransport | None = None


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``num`` Poisson arrivals at ``rate`` requests/s.

    Inter-arrival gaps are exponential draws from ``random.Random(seed)``; the first request
    goes at 0. An infinite (or non-positive) rate sends everything at once.
    """
    if not math.isfinite(rate) or rate <= 0:
        return [0.0] * num
    rng = random.Random(seed)
    return list(accumulate([0.0] + [rng.expovariate(rate) for _ in range(num - 1)]))[:num]


def _payload(config: ServeConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streamed, greedy request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    """The new text of one streamed chunk (completions ``text`` or chat ``delta.content``)."""
    choice = (data.get("choices") or [{}])[0]
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, t0: float
) -> RequestRecord:
    """Stream one request and fill ``record``; errors are recorded, never raised."""
    start = time.perf_counter()
    record.send_s = start - t0
    last, chunks, usage_tokens = start, 0, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {resp.status_code}: {text}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                line = line[5:].strip()
                if line == "[DONE]":
                    break
                data = json.loads(line)
                if data.get("error"):
                    record.error = f"stream error: {data['error']}"
                    return record
                now = time.perf_counter()
                usage = data.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                if _chunk_text(data):
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
        record.e2e = time.perf_counter() - start
        record.output_tokens = usage_tokens if usage_tokens is not None else chunks
        record.success = chunks > 0 or usage_tokens is not None  # an empty reply is no failure
        if not record.success:
            record.error = "no content or usage received"
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id served at ``base_url`` (the server root; GET /v1/models)."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} serves no models")
    return models[0]["id"]


def build_requests(config: ServeConfig) -> list[BenchRequest]:
    """The benchmark's requests from the tokenizer and dataset (or ``config.requests``).

    ``random`` prompts are token ids (sent as such to completions, decoded for chat) of
    ``random_input_len`` (default ``max_prompt_len``) tokens, each asking for
    ``random_output_len`` (default ``max_output_len``) tokens.
    """
    if config.requests is not None:
        return list(config.requests)
    from tandem.models.loader import default_model_path
    from tandem.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(config.tokenizer or default_model_path())
    if config.dataset == "sharegpt":
        return load_sharegpt(
            config.num_prompts,
            tok,
            seed=config.seed,
            max_prompt_len=config.max_prompt_len,
            max_total_len=config.max_prompt_len + config.max_output_len,
            max_output_len=config.max_output_len,
        )
    reqs = random_requests(
        config.num_prompts,
        config.random_input_len or config.max_prompt_len,
        config.random_output_len or config.max_output_len,
        tok.vocab_size,
        config.seed,
    )
    if config.endpoint == "chat":
        for r in reqs:
            r.prompt = tok.decode(list(r.prompt))
    return reqs


def machine_info() -> dict[str, Any]:
    """Where the client ran (the server may be elsewhere)."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "httpx_version": httpx.__version__,
    }


async def run_benchmark(config: ServeConfig) -> dict[str, Any]:
    """Run the benchmark; returns (and unless ``config.save`` is false, writes) the result.

    The result holds ``config``, ``machine``, ``metrics`` and per-request ``records``, plus
    ``output_path`` and ``plot_path`` when saved.
    """
    from tqdm import tqdm

    if config.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {config.endpoint!r}")
    if config.dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {config.dataset!r}")
    if config.num_prompts < 1 or (
        config.max_concurrency is not None and config.max_concurrency < 1
    ):
        raise ValueError("num_prompts and max_concurrency must be >= 1")
    reqs = build_requests(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.timeout_s),
        limits=limits,
        transport=config.transport,
    ) as client:
        base = config.base_url.rstrip("/").removesuffix("/v1")  # the server root
        model = config.model or await fetch_model(client, base)
        url = base + ("/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions")
        offsets = arrival_offsets(len(reqs), config.request_rate, config.seed)
        sem: AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else nullcontext()
        )
        bar = tqdm(total=len(reqs), desc="serve bench", disable=config.disable_tqdm)
        t0 = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            record = RequestRecord(req.prompt_len, req.output_len)
            async with sem:
                await send_request(client, url, _payload(config, model, req), record, t0)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(r, o) for r, o in zip(reqs, offsets, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
    cfg = {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if f.name not in ("requests", "transport", "api_key")
    }
    cfg.update(model=model, request_rate=str(config.request_rate), num_requests=len(reqs))
    result: dict[str, Any] = {
        "config": cfg,
        "machine": machine_info(),
        "metrics": compute_metrics(records, duration),
        "records": [asdict(r) for r in records],
    }
    print(format_table(result["metrics"]))
    if config.save:
        save_result(result, config.out_dir, config.label or config.dataset)
    return result


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``tandem bench serve`` to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model (default: first listed)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    parser.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals (default inf: all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--random-input-len", type=int, default=None)
    parser.add_argument("--random-output-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM's extra field) for exact output lengths",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="model path for the tokenizer (default: SmolLM2's GGUF)"
    )
    parser.add_argument(
        "--timeout", dest="timeout_s", type=float, default=600.0, help="seconds per request"
    )
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--label", default=None)


def main_from_args(args: argparse.Namespace) -> int:
    """Run the serving benchmark from parsed CLI arguments; 1 if no request succeeded."""
    names = {f.name for f in fields(ServeConfig)} - {"requests", "transport"}
    config = ServeConfig(**{k: v for k, v in vars(args).items() if k in names})
    result = asyncio.run(run_benchmark(config))
    return 0 if result["metrics"]["successful_requests"] else 1
