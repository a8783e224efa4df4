"""Command line: ``tandem serve``, ``tandem router``, ``tandem generate``, ``tandem bench``
and ``tandem train-mtp``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tandem.engine_options import add_engine_arguments, engine_kwargs
from tandem.server.tool_choice import TOOL_CALL_PARSERS

# ``tandem serve``: the exit status when the engine core died or stalled (a supervisor
# restarts the server), how long /health reports it before the exit, and how long open
# connections may take to close at shutdown.
ENGINE_DEAD_EXIT_CODE = 1
STARTUP_FAILED_EXIT_CODE = 3  # as uvicorn.run's
DEAD_ENGINE_LINGER_S = 2.0
SHUTDOWN_GRACE_S = 10.0

DISAGG_SECRET_HELP = (
    "PD: the deployment's shared secret, the same on every instance and the router (16+ "
    "characters; default: $TANDEM_DISAGG_SECRET): it signs control messages and the prefill "
    "URLs the router names"
)


def _generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams
    from tandem.models.tensor_parallel import join_torchrun_group

    options = engine_kwargs(args)
    options["device"], rank = join_torchrun_group(args.device, args.tensor_parallel_size)
    llm = LLM(model=args.model, **options)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    if args.raw:
        output = llm.generate(args.prompt, params)[0]
    else:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    completion = output.outputs[0]
    if rank != 0:  # every rank generated the same tokens: one prints them
        return 0
    print(completion.text)
    print(
        f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
        f"finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def engine_config(args: argparse.Namespace):
    """An EngineConfig from the shared engine options."""
    from tandem.llm import engine_config as build

    return build(args.model, **engine_kwargs(args))


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import uvicorn

    from tandem.config import DisaggConfig
    from tandem.disagg.trust import require_secret, resolve_secret
    from tandem.models.loader import DEFAULT_SERVED_NAME, resolve_model
    from tandem.models.tensor_parallel import check_rank_devices
    from tandem.server.app import build_app
    from tandem.server.engine_client import AsyncEngineClient

    check_rank_devices(args.device, args.tensor_parallel_size)  # before any process starts
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("tandem: error: --enable-auto-tool-choice needs --tool-call-parser")
    secret = resolve_secret(args.disagg_secret)
    if args.role != "mixed":
        require_secret(secret, f"--role {args.role}")
    config = replace(
        engine_config(args),
        disagg=DisaggConfig(
            role=args.role,
            kv_connector=args.kv_connector,
            control_host=args.disagg_host,
            control_port=args.disagg_port,
            transfer_timeout_s=args.transfer_timeout_s,
            secret=secret,
        ),
    )
    name = args.served_model_name
    if name is None:
        path = resolve_model(args.model)
        name = DEFAULT_SERVED_NAME if args.model is None else path.rstrip("/").split("/")[-1]
    client = AsyncEngineClient(
        config,
        stall_timeout_s=args.engine_stall_timeout_s,
        step_timeout_s=args.engine_step_timeout_s or None,
        request_timeout_s=args.request_timeout_s or None,
    )
    app = build_app(
        client,
        name,
        api_key=args.api_key,
        max_pending_requests=args.max_pending_requests,
        metrics_without_key=args.metrics_without_key,
        max_request_body_bytes=args.max_request_body_bytes,
        disagg_secret=secret,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    client.on_dead = lambda why: _exit_soon(server, why)
    try:
        server.run()
    finally:
        client.remove_socket_dir()  # also when startup failed or the loop died
    if not server.started:
        return STARTUP_FAILED_EXIT_CODE
    if client.dead is not None:
        print(f"tandem: error: the engine core is gone ({client.dead}); exiting", file=sys.stderr)
        return ENGINE_DEAD_EXIT_CODE
    return 0


def _exit_soon(server, why: str) -> None:
    """Stop ``server`` ``DEAD_ENGINE_LINGER_S`` after its engine core was found dead: until
    then /health says why (503) to whoever watches it; then the process exits non-zero."""
    import asyncio

    logging.getLogger("tandem.server").error("engine core dead: %s; the server exits", why)
    asyncio.get_running_loop().call_later(
        DEAD_ENGINE_LINGER_S, lambda: setattr(server, "should_exit", True)
    )


def _router(args: argparse.Namespace) -> int:
    from tandem.disagg.trust import require_secret, resolve_secret
    from tandem.server.router import run_router

    secret = require_secret(resolve_secret(args.disagg_secret), "tandem router")
    run_router(
        args.prefill,
        args.decode,
        args.host,
        args.port,
        log_level=args.log_level,
        health_interval_s=args.health_interval_s,
        request_timeout_s=args.request_timeout_s,
        max_request_body_bytes=args.max_request_body_bytes,
        disagg_secret=secret,
        api_key=args.api_key,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a reply to one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None, help="GGUF file, HF directory or dummy:NAME")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--raw", action="store_true", help="skip the chat template")
    add_engine_arguments(generate)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="GGUF file, HF directory or dummy:NAME (default: SmolLM2-135M)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (the docs, "
        "/metrics and /v1/disagg/info included)",
    )
    serve.add_argument(
        "--metrics-without-key", action="store_true", help="with --api-key: /metrics open"
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="refuse (413) a larger request body without reading it (default: 64 bytes per "
        "token of the max model length, at least 4 MiB)",
    )
    serve.add_argument(
        "--request-timeout-s",
        type=float,
        default=0,
        help="abort a request (504, or an error event in a stream) still running this long "
        "after it was submitted, freeing its KV blocks (default 0: no deadline)",
    )
    serve.add_argument(
        "--engine-stall-timeout-s",
        type=float,
        default=30.0,
        help="the engine core is dead when it sent no heartbeat for this long (stopped, "
        "frozen): requests fail, /health is 503 and the server exits with status "
        f"{ENGINE_DEAD_EXIT_CODE} for a supervisor (systemd, Kubernetes) to restart it; "
        "so does a core process that exits",
    )
    serve.add_argument(
        "--engine-step-timeout-s",
        type=float,
        default=600.0,
        help="... or one step this long (0: none)",
    )
    serve.add_argument(
        "--max-pending-requests", type=int, default=1024, help="503 beyond this many requests"
    )
    serve.add_argument("--log-level", default="info", help="uvicorn's log level")
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": tool calls parsed out of the reply in the format of '
        "--tool-call-parser (the chat template must show the model its tools)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>, Hermes "
        "and Qwen models) or llama3_json (Llama 3.1's JSON calls)",
    )
    serve.add_argument(
        "--role",
        choices=["mixed", "prefill", "decode"],
        default="mixed",
        help="PD disaggregation: run whole requests (mixed), or only prompts "
        "for decode instances (prefill), or decode after a prefill instance",
    )
    serve.add_argument(
        "--kv-connector",
        choices=["zmq", "mooncake", "nccl", "cuda_ipc"],
        default="zmq",
        help="how KV moves: zmq (default; signed messages), mooncake (TCP/RDMA), nccl or cuda_ipc",
    )
    serve.add_argument(
        "--disagg-host",
        default="127.0.0.1",
        help="address peers reach this instance's control channel and KV on, and the only "
        "one they listen on (but Mooncake's ports: see docs/architecture.md, PD trust)",
    )
    serve.add_argument(
        "--disagg-port", type=int, default=0, help="control channel port (default: a free one)"
    )
    serve.add_argument("--disagg-secret", default=None, help=DISAGG_SECRET_HELP)
    serve.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=30.0,
        help="a decode instance fails a request whose KV has not come by then",
    )
    add_engine_arguments(serve)
    serve.set_defaults(handler=_serve)

    router = commands.add_parser(
        "router", help="OpenAI API in front of prefill and decode instances (PD disaggregation)"
    )
    router.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill instances' base URLs (http://host:port)",
    )
    router.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instances' base URLs"
    )
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--health-interval-s", type=float, default=2.0)
    router.add_argument("--request-timeout-s", type=float, default=600.0)
    router.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=64 << 20,
        help="refuse (413) a larger request body without reading it",
    )
    router.add_argument("--log-level", default="info")
    router.add_argument("--disagg-secret", default=None, help=DISAGG_SECRET_HELP)
    router.add_argument("--api-key", help="require 'Authorization: Bearer KEY' but on /health")
    router.set_defaults(handler=_router)

    train = commands.add_parser("train-mtp", help="distill an MTP head for a base model")
    from tandem.train import mtp_cli

    mtp_cli.add_cli_arguments(train)
    train.set_defaults(handler=mtp_cli.main_from_args)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, module_name, help_text in (  # `tandem bench NAME`, its tandem.bench module
        ("throughput", "throughput", "offline throughput against HF"),
        ("serve", "serving", "online benchmark of an OpenAI server"),
        ("spec", "spec", "MTP acceptance and speedup on held-out prompts, per head"),
        ("decode", "decode", "decode tokens/s and GPU idle fraction"),
        ("latency", "latency", "ms per output token against the bandwidth roofline"),
        ("pd", "pd", "prefill/decode disaggregation against a mixed instance"),
    ):
        module = importlib.import_module(f"tandem.bench.{module_name}")
        command = bench_commands.add_parser(name, help=help_text)
        module.add_cli_arguments(command)
        command.set_defaults(handler=module.main_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
