"""OpenAI-compatible request bodies (with vLLM's extra sampling fields) and error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling_params import MAX_LOGPROBS, SamplingParams


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

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build validated SamplingParams (ValueError names the bad field)."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n}")
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
                raise ValueError("prompt: only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt: a token-id prompt must be a list of integers")
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    def checked_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part type {part.get('type')!r} is not text")
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
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}"
                )
        return (self.top_logprobs or 0) if self.logprobs else None


# PD: the header by which a router names the prefill instance (its base URL) of a request
# that it sends to a decode instance.
PREFILL_URL_HEADER = "x-tandem-prefill-url"


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """The OpenAI error schema."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
