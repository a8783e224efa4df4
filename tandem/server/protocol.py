"""OpenAI-compatible request bodies (with vLLM's extra sampling fields) and error bodies."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    ParamError,
    SamplingParams,
    check_int,
    check_text,
)
from tandem.server.chat_messages import STRICT, ChatMessage
from tandem.server.request_constraints import guided_constraint, token_bias

logger = logging.getLogger(__name__)

# Request bodies of the generating routes are open: a field no one declares is ignored with
# a warning in the log (as vLLM does), but a field of OpenAI's or vLLM's API that Tandem does
# not implement is a 400 naming it (never accepted and ignored).
OPEN = ConfigDict(extra="allow", strict=True)
REFUSED_COMMON = frozenset(
    {
        "length_penalty",
        "use_beam_search",
        "truncate_prompt_tokens",
        "allowed_token_ids",
        "bad_words",
        "spaces_between_special_tokens",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structured_outputs",
        "structural_tag",
        "logits_processors",
        "priority",
        "request_id",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
        "return_tokens_as_token_ids",
        "add_special_tokens",
    }
)
REFUSED_CHAT = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "echo",
        "continue_final_message",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
    }
)

# OpenAI fields Tandem does not implement, with the values that ask for nothing (accepted);
# any other value is a 400 naming the field, never accepted and ignored.
UNSUPPORTED_COMPLETION = MappingProxyType({"suffix": (None, "")})
# The most samples one request may ask for (``n``): each is an engine request.
MAX_N = 128
# OpenAI's and vLLM's default output limit of a completion that names none.
DEFAULT_COMPLETION_MAX_TOKENS = 16
UNSUPPORTED_CHAT = MappingProxyType(
    {
        "functions": (None, []),
        "function_call": (None, "none"),
        "modalities": (None, ["text"]),
        "audio": (None,),
        "prediction": (None,),
        "best_of": (None, 1),  # vLLM's legacy field: one sample a choice is all it can ask
    }
)


class StreamOptions(BaseModel):
    """``stream_options``: only with ``stream: true``."""

    model_config = STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = OPEN
    refused: ClassVar[frozenset[str]] = REFUSED_COMMON  # undeclared fields that are a 400

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extensions: each choice also carries the generated token ids; the prompt
    # tokens' logprobs (with this many top entries; the first is null).
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    user: str | None = None
    # Token id (a decimal string, as OpenAI's) -> a bias in [-100, 100] added to its logit;
    # the penalties (vLLM's repetition_penalty too), as SamplingParams applies them.
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Structured output (one per request): OpenAI's response_format (json_object,
    # json_schema; text is none) and vLLM's guided_* fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """ParamError naming the first field that asks for a feature Tandem does not have
        (or ``stream_options`` without ``stream``)."""
        ignored = []
        for name in self.model_extra or {}:
            check_text("field name", name)
            if name in self.refused:
                raise ParamError(name, f"{name} is not supported by this server")
            ignored.append(name)
        if ignored:
            logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(ignored)))
        for name, neutral in self._unsupported().items():
            if not _is_neutral(getattr(self, name), neutral):
                raise ParamError(name, f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")

    @staticmethod
    def _unsupported() -> MappingProxyType:
        return MappingProxyType({})

    def guided_constraint(self) -> tuple[str, dict | None]:
        """The structured-output constraint asked for and the field that asks."""
        return guided_constraint(self)

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        renamed: dict[str, str] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build validated SamplingParams (ParamError names the bad field as the request
        spelled it: ``renamed`` maps SamplingParams' names to the request's);
        ``prompt_logprobs``: the top entries per prompt token (default: the request's
        field)."""
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        check_int("n", self.n, 1, MAX_N)
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=token_bias(self.logit_bias),
                guided=self.guided_constraint()[1],
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ParamError as e:
            name = (renamed or {}).get(e.param)
            if e.param == "guided":
                name = self.guided_constraint()[0]
            if name is None:
                raise
            raise ParamError(name, str(e).replace(e.param, name, 1)) from None


def _is_neutral(value: object, neutral: tuple) -> bool:
    """True if ``value`` is one of ``neutral`` (None only matching None: 0 is not None)."""
    return any(value is None if v is None else value is not None and value == v for v in neutral)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None)
    # The prompt's text (and with logprobs its tokens' logprobs) before the completion.
    echo: bool = False
    # Samples per prompt of which the ``n`` with the highest cumulative logprob are returned.
    best_of: int | None = None
    # Not implemented: refused unless neutral (UNSUPPORTED_COMPLETION).
    suffix: str | None = None

    @staticmethod
    def _unsupported() -> MappingProxyType:
        return UNSUPPORTED_COMPLETION

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or a list of texts or of token-id lists), each
        checked; a ParamError names the bad one."""
        prompt = self.prompt
        many = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if many else [prompt]
        for i, one in enumerate(prompts):
            name = f"prompt[{i}]" if many else "prompt"
            if isinstance(one, list) and not all(isinstance(t, int) for t in one):
                raise ParamError(name, f"{name}: a token-id prompt must be a list of integers")
            if not one:
                raise ParamError(name, f"{name} is empty")
            if isinstance(one, str):
                check_text(name, one)
        return prompts

    def checked_best_of(self) -> int:
        """How many samples to draw per prompt: ``best_of`` (n to 128; not with stream),
        else ``n``."""
        if self.best_of is None:
            return self.n
        check_int("best_of", self.best_of, 1, MAX_N)
        if self.best_of < self.n:
            raise ParamError("best_of", f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.stream and self.best_of > self.n:
            raise ParamError("best_of", "best_of > n cannot be used with stream")
        return self.best_of

    def checked_max_tokens(self) -> int:
        """The output limit (default 16); 0 only with ``echo`` (the prompt scored, nothing
        generated)."""
        if self.max_tokens is None:
            return DEFAULT_COMPLETION_MAX_TOKENS
        if self.max_tokens == 0 and self.echo:
            return 0
        check_int("max_tokens", self.max_tokens, 1, MAX_COUNT)
        return self.max_tokens

    def checked_logprobs(self) -> int | None:
        """The number of top logprobs asked for (None: none)."""
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        return self.logprobs


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    refused: ClassVar[frozenset[str]] = REFUSED_COMMON | REFUSED_CHAT

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Function calling (tandem/server/tool_choice.py).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Not implemented: refused unless neutral (UNSUPPORTED_CHAT).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    best_of: int | None = None

    @staticmethod
    def _unsupported() -> MappingProxyType:
        return UNSUPPORTED_CHAT

    def checked_logprobs(self) -> int | None:
        """The number of top logprobs asked for (None: no logprobs)."""
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
            check_int("top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        return (self.top_logprobs or 0) if self.logprobs else None

    def checked_max_tokens(self) -> tuple[int | None, str]:
        """The output limit and the field that set it (``max_completion_tokens`` wins; 0 is
        refused, not read as "no limit")."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# PD: the header by which a router names the prefill instance (its base URL) of a request
# that it sends to a decode instance.
PREFILL_URL_HEADER = "x-tandem-prefill-url"


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """The OpenAI error schema: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
