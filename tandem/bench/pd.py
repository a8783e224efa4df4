"""``tandem bench pd``: prefill/decode disaggregation against a mixed instance, under a load
that mixes long prompts with running decodes.

Each run starts engine-core processes through the same client the HTTP server uses: one
mixed instance, then a prefill and a decode instance (the decode instance asks the
prefill instance for each prompt's KV; ``--kv-connector`` moves it: ``cuda_ipc`` between
two processes on one GPU host, ``nccl`` by point-to-point send/recv (``--prefill-device cuda:0
--decode-device cuda:1`` puts the two instances on two GPUs; the mixed instance runs on
``--device``), ``mooncake`` over TCP/RDMA, ``zmq`` over signed ZeroMQ messages). The load:
``num_decode`` requests with short prompts decoding ``decode_output_len`` tokens each, all
from the start, and ``num_long`` requests of ``long_prompt_len``-token prompts arriving every
``long_interval_s``. Reported: inter-token latency (p50, p99, max) of the decoding
requests (in a mixed instance, the long prefills share its steps), time to first token of
the long requests, and for PD the KV transfer rate (bytes over the connector's write time)
and the per-request handoff latency (from the prefill instance's ``transferring``, sent
when its first token is done, to the decode instance holding the KV and that token).
Before each load, a warm-up request pair takes the first-use costs (compiles, the KV
connector's first connection); the reported numbers leave it out.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import replace

from tandem.bench.datasets import random_requests
from tandem.bench.results import result_path, write_json
from tandem.bench.serving_report import latency_stats


def _new_record() -> dict:
    """What ``_run_one`` fills in for one request."""
    return {"ttft": None, "itl": [], "tokens": 0, "error": None}


async def _run_one(
    client, prompt: list[int], params, remote: str | None, delay: float, record: dict
) -> None:
    from tandem.server.engine_client import RequestFailed

    await asyncio.sleep(delay)
    start = last = time.perf_counter()
    try:
        async for output in client.generate(None, prompt, params, remote):
            now = time.perf_counter()
            new = len(output.outputs[0].token_ids)
            if new:
                if record["ttft"] is None:
                    record["ttft"] = now - start
                else:
                    record["itl"] += [(now - last) / new] * new
                last = now
                record["tokens"] += new
    except RequestFailed as e:
        record["error"] = str(e)


async def _load(decode_client, remote: str | None, vocab: int, args) -> dict:
    from tandem import SamplingParams

    short = random_requests(
        args.num_decode, args.decode_prompt_len, args.decode_output_len, vocab, seed=1
    )
    long = random_requests(args.num_long, args.long_prompt_len, args.long_output_len, vocab, seed=2)
    records = {"decode": [], "long": []}
    tasks = []
    for kind, requests, delays in (
        ("decode", short, [0.0] * len(short)),
        ("long", long, [args.long_start_s + i * args.long_interval_s for i in range(len(long))]),
    ):
        for request, delay in zip(requests, delays, strict=True):
            record = _new_record()
            records[kind].append(record)
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            tasks.append(_run_one(decode_client, request.prompt, params, remote, delay, record))
    start = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    itl = [x for r in records["decode"] for x in r["itl"]]
    ttft = [r["ttft"] for r in records["long"] if r["ttft"] is not None]
    return {
        "elapsed_s": elapsed,
        "errors": sum(r["error"] is not None for rs in records.values() for r in rs),
        "decode_itl": {
            **latency_stats(itl),
            "max_ms": max(itl, default=0) * 1000,
            "count": len(itl),
        },
        "long_ttft": latency_stats(ttft),
        "output_tokens": sum(r["tokens"] for rs in records.values() for r in rs),
    }


async def _warm_up(client, remote: str | None, vocab: int, args) -> float:
    """Send one long and one short request (two tokens each) at once, so first-use costs
    (Triton compiles, the KV connector's first connection) stay out of the measured load;
    returns the seconds it took. Raises ``RuntimeError`` if a request fails."""
    from tandem import SamplingParams

    # seeds apart from the load's (1, 2) and from each other: no prefix-cache hits
    requests = random_requests(1, args.long_prompt_len, 2, vocab, seed=3) + random_requests(
        1, args.decode_prompt_len, 2, vocab, seed=4
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    records = [_new_record() for _ in requests]
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _run_one(client, request.prompt, params, remote, 0.0, record)
            for request, record in zip(requests, records, strict=True)
        )
    )
    errors = [r["error"] for r in records if r["error"] is not None]
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]}")
    return time.perf_counter() - start


async def _bench(args) -> dict:
    from tandem.config import DisaggConfig
    from tandem.llm import engine_config
    from tandem.server.engine_client import AsyncEngineClient

    def on(device: str):
        return engine_config(
            args.model,
            device=device,
            dtype=args.dtype,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative="mtp" if args.mtp else None,
            num_speculative_tokens=args.num_speculative_tokens,
        )

    base = on(args.device)
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "handler"}}

    mixed = AsyncEngineClient(base)
    await mixed.start()
    vocab = mixed.info.vocab_size
    warmup_s = await _warm_up(mixed, None, vocab, args)
    result["mixed"] = {**await _load(mixed, None, vocab, args), "warmup_s": warmup_s}
    await mixed.shutdown()
    print(f"mixed: {json.dumps(result['mixed'])}", flush=True)

    secret = secrets.token_hex(16)  # the pair's shared secret (control messages are signed)

    def role(name: str, device: str):
        return replace(
            on(device),
            disagg=DisaggConfig(
                role=name,
                kv_connector=args.kv_connector,
                transfer_timeout_s=args.transfer_timeout_s,
                secret=secret,
            ),
        )

    prefill = AsyncEngineClient(role("prefill", args.prefill_device))
    decode = AsyncEngineClient(role("decode", args.decode_device))
    try:
        await prefill.start()
        await decode.start()
        remote = prefill.info.control_address
        warmup_s = await _warm_up(decode, remote, vocab, args)
        await asyncio.sleep(0.5)  # the warm-up's last stats frames
        p0, d0 = dict(prefill.stats), dict(decode.stats)
        result["pd"] = {**await _load(decode, remote, vocab, args), "warmup_s": warmup_s}
        await asyncio.sleep(0.5)  # the last stats frames
        p1, d1 = prefill.stats, decode.stats

        def p(key):  # the prefill instance's counter over the measured load only
            return p1.get(key, 0) - p0.get(key, 0)

        def d(key):
            return d1.get(key, 0) - d0.get(key, 0)

        seconds = p("pd_kv_transfer_s")
        # No handoff max: pd_handoff_s_max is a running max since start, so it would
        # include the warm-up's handoff (the connector's first connection).
        result["pd"].update(
            {
                "kv_transfers": p("pd_kv_transfers"),
                "kv_bytes": p("pd_kv_bytes"),
                "kv_gb_per_s": p("pd_kv_bytes") / seconds / 1e9 if seconds else None,
                "kv_transfer_ms_mean": (
                    seconds / p("pd_kv_transfers") * 1000 if p("pd_kv_transfers") else None
                ),
                "handoff_ms_mean": (
                    d("pd_handoff_s_sum") / d("pd_handoffs") * 1000 if d("pd_handoffs") else None
                ),
                "failures": p("pd_failures") + d("pd_failures"),
                "prefill_steps": p("num_steps"),
                "decode_steps": d("num_steps"),
            }
        )
    finally:
        await decode.shutdown()
        await prefill.shutdown()
    print(f"pd: {json.dumps(result['pd'])}", flush=True)
    return result


def add_cli_arguments(parser) -> None:
    """Options of ``tandem bench pd``."""
    parser.add_argument("--model", default=None, help="GGUF file, HF directory or dummy:NAME")
    parser.add_argument("--device", default="cpu", help="the mixed instance's")
    parser.add_argument("--prefill-device", default=None, help="default: --device")
    parser.add_argument("--decode-device", default=None, help="default: --device")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--kv-connector", choices=["mooncake", "zmq", "nccl", "cuda_ipc"], default="mooncake"
    )
    parser.add_argument(
        "--kv-cache-memory-gb", type=float, default=1.0, help="per instance (two share one GPU)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--mtp", action="store_true", help="MTP speculative decoding on both")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--transfer-timeout-s", type=float, default=60.0)
    parser.add_argument("--num-decode", type=int, default=32)
    parser.add_argument("--decode-prompt-len", type=int, default=128)
    parser.add_argument("--decode-output-len", type=int, default=256)
    parser.add_argument("--num-long", type=int, default=16)
    parser.add_argument("--long-prompt-len", type=int, default=2000)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-start-s", type=float, default=0.2)
    parser.add_argument("--long-interval-s", type=float, default=0.1)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))


def main_from_args(args) -> int:
    """Run ``tandem bench pd``."""
    import torch

    args.prefill_device = args.prefill_device or args.device  # recorded in the result's config
    args.decode_device = args.decode_device or args.device
    result = asyncio.run(_bench(args))
    result["torch_version"] = torch.__version__
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    if args.out_dir:
        path = result_path(args.out_dir, f"pd-{args.device.split(':')[0]}-{args.kv_connector}")
        write_json(result, path)
        print(f"wrote {path}")
    return 0
