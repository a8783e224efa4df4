"""OpenAI-compatible request bodies (with vLLM's extra sampling fields) and error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling_params import (
    MAX_LOGPROBS,
    ParamError,
    SamplingParams,
    check_int,
    check_text,
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    # vLLM's extension: each choice also carries the generated token ids.
    return_token_ids: bool = False
    user: str | None = None

    def to_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, renamed: dict[str, str] | None = None
    ) -> SamplingParams:
        """Build validated SamplingParams (ParamError names the bad field as the request
        spelled it: ``renamed`` maps SamplingParams' names to the request's)."""
        check_int("n", self.n)
        if self.n != 1:
            raise ParamError("n", f"n must be 1 (parallel sampling is not supported), got {self.n}")
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
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ParamError as e:
            name = (renamed or {}).get(e.param)
            if name is None:
                raise
            raise ParamError(name, str(e).replace(e.param, name, 1)) from None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list of one prompt is accepted too)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ParamError("prompt", "prompt: only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise ParamError("prompt", "prompt: a token-id prompt must be a list of integers")
        if not prompt:
            raise ParamError("prompt", "prompt is empty")
        if isinstance(prompt, str):
            check_text("prompt", prompt)
        return prompt

    def checked_logprobs(self) -> int | None:
        """The number of top logprobs asked for (None: none)."""
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str = "messages") -> str:
        """The message's text; ParamError (``param`` is ``where`` and the part) for a part
        that is not text or whose text is not a string of valid Unicode."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            check_text(f"{where}.content", self.content)
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            name = f"{where}.content[{i}]"
            if part.get("type") != "text":
                kind = part.get("type")
                shown = repr(kind) if isinstance(kind, str) and len(kind) < 40 else "not text"
                raise ParamError(f"{name}.type", f"{name}: content part type {shown} is not text")
            check_text(f"{name}.text", part.get("text", ""))
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

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
