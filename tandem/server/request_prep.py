"""Completion and chat requests checked and made ready for the engine: one prepared run per
prompt and sample."""

from __future__ import annotations

import hashlib
import time
import uuid
from copy import copy
from dataclasses import dataclass, field, replace

from tandem.sampling_params import ParamError, SamplingParams
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.tool_choice import ToolPlan, plan_tools, tool_constraint


@dataclass
class PreparedRequest:
    """A validated request ready for the engine."""

    kind: str  # "completion" or "chat"
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    # PD: the control address of the prefill instance that computes the prompt's KV.
    remote_prefill: str | None = None
    # The engine's request id; the response's id ("cmpl-..." / "chatcmpl-...") is the same
    # unless the request has several prompts (then each runs as "<response id>-<index>").
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice's index
    response_id: str = ""
    # Completions: the prompt's text before the completion (``echo``); with
    # ``discard_output`` (``max_tokens: 0``) nothing generated is returned.
    echo: str | None = None
    discard_output: bool = False
    # vLLM's ``prompt_logprobs`` field: the top entries per prompt token (None: not asked).
    prompt_logprobs: int | None = None
    # ``n`` > 1: the run (of this request) whose prefill this sample waits for.
    waits_for: int | None = None
    # ``best_of`` > n: the samples per prompt are ranked and this many kept; the engine
    # computes logprobs for the ranking that the response leaves out (``hide_logprobs``).
    keep_best: int | None = None
    hide_logprobs: bool = False
    samples: int = 1  # the samples drawn per prompt (``n``, or ``best_of``)
    # Chat with tools: how the reply becomes tool calls (None: text only).
    tools: ToolPlan | None = None


def prepare_completion(body: CompletionRequest, client: AsyncEngineClient) -> list[PreparedRequest]:
    """A validated completion request: one prepared run per prompt (ParamError names a bad
    field)."""
    body.check_supported()
    prompts = body.prompts()
    max_tokens = body.checked_max_tokens()
    logprobs = body.checked_logprobs()
    # The engine's prompt logprobs: what echo with logprobs and prompt_logprobs ask for.
    wanted = [body.prompt_logprobs]
    if body.echo and logprobs is not None:
        wanted.append(logprobs)
    wanted = [n for n in wanted if n is not None]
    best_of = body.checked_best_of()
    ranked = best_of > body.n
    # Ranking samples needs their cumulative logprobs: asked of the engine, not returned.
    engine_logprobs = 0 if ranked and logprobs is None else logprobs
    params = body.to_sampling_params(
        max(max_tokens, 1), engine_logprobs, prompt_logprobs=max(wanted) if wanted else None
    )
    runs = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, token_ids = prompt, client.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        try:
            prepared = _prepared("completion", text, token_ids, copy(params), body, client)
        except ParamError as e:
            if len(prompts) == 1 or e.param != "prompt":
                raise
            raise ParamError(f"prompt[{index}]", f"prompt[{index}]: {e}") from None
        if body.echo:
            prepared.echo = text if text is not None else client.tokenizer.decode(token_ids, False)
        prepared.discard_output = max_tokens == 0
        prepared.prompt_logprobs = body.prompt_logprobs
        prepared.hide_logprobs = logprobs is None
        prepared.keep_best = body.n if ranked else None
        runs.append(prepared)
    return _fan_out(runs, best_of)


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` (of ``n``) of a request seeded with ``seed``: the
    request's own for the first, a hash of both for the others; None stays None (each
    sample then gets its own seed from the engine)."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _fan_out(prepared: list[PreparedRequest], n: int) -> list[PreparedRequest]:
    """``n`` samples of each prompt's run: choice ``prompt * n + sample``, each an engine
    request ``<response id>-<choice>`` when there are several. A sample after its prompt's
    first waits for the first's prefill (``waits_for``), so that it finds the prompt's blocks
    in the prefix cache: the prompt is prefilled once."""
    runs: list[PreparedRequest] = []
    for prompt_index, first in enumerate(prepared):
        first_run = len(runs)
        for sample in range(n):
            one = first
            if sample:
                params = replace(first.params, seed=sample_seed(first.params.seed, sample))
                one = replace(first, params=params, waits_for=first_run)
            one.index, one.samples = prompt_index * n + sample, n
            runs.append(one)
    if len(runs) > 1:
        response_id = runs[0].response_id
        for one in runs:
            one.request_id, one.response_id = f"{response_id}-{one.index}", response_id
    return runs


def prepare_chat(
    body: ChatCompletionRequest, client: AsyncEngineClient, tool_parser: str | None = None
) -> list[PreparedRequest]:
    """A validated chat request (ParamError names a bad field; a prompt problem names
    ``messages``). ``tool_parser``: the format of tool calls with ``tool_choice: "auto"``
    (None: the server has no automatic tool choice)."""
    body.check_supported()
    if not body.messages:
        raise ParamError("messages", "messages must not be empty")
    messages = [m.template_fields(f"messages[{i}]") for i, m in enumerate(body.messages)]
    max_tokens, max_tokens_field = body.checked_max_tokens()
    renamed = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"}
    params = body.to_sampling_params(max_tokens, body.checked_logprobs(), renamed)
    plan, tools = plan_tools(body, tool_parser)
    constraint_field = None
    if (constraint := tool_constraint(plan, tools)) is not None:
        if params.guided is not None:
            asked = body.guided_constraint()[0]
            message = f"{asked} and tool_choice {plan.mode!r}: one constraint at most"
            raise ParamError(asked, message)
        params = replace(params, guided=constraint)
        constraint_field = "tools"
    token_ids = client.tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools)
    try:
        prepared = _prepared("chat", None, token_ids, params, body, client, constraint_field)
        prepared.prompt_logprobs = body.prompt_logprobs
        prepared.tools = plan
        return _fan_out([prepared], body.n)
    except ParamError as e:
        if e.param != "prompt":
            raise
        raise ParamError("messages", str(e)) from None


def _prepared(
    kind, text, token_ids, params, body, client, constraint_field=None
) -> PreparedRequest:
    try:
        client.validate_prompt(token_ids, params)
    except ParamError as e:  # a constraint that does not compile: named as the body asks
        if e.param != "guided":
            raise
        raise ParamError(constraint_field or body.guided_constraint()[0], str(e)) from None
    if params.max_tokens is None:
        params.max_tokens = client.info.max_model_len - len(token_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    request_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    return PreparedRequest(
        kind,
        text,
        token_ids,
        params,
        body.stream,
        include_usage,
        body.return_token_ids,
        request_id=request_id,
        response_id=request_id,
    )
