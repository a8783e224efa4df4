"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over
HTTP, with vLLM's request and response shapes.

``/tokenize`` takes a text (``prompt``) or a chat (``messages``, rendered and tokenized as
the chat endpoint does it, so its ``count`` is a chat request's ``usage.prompt_tokens``).
Neither route runs the engine: a prompt longer than the context is counted, not refused.
Bodies are strict like the completions routes' (a wrong type, an unknown field, a lone
surrogate or an id outside the vocabulary is a 400 naming the field), and a wrong ``model``
gets the completions routes' 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from tandem.sampling_params import ParamError, check_text
from tandem.server.chat_messages import STRICT, ChatMessage
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.errors import ApiError, check_model
from tandem.server.tool_choice import checked_tools
from tandem.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's two bodies in one model, ``prompt`` (its completion form:
    ``add_special_tokens`` defaults to true) or ``messages`` (its chat form:
    ``add_generation_prompt`` defaults to true, ``add_special_tokens`` to false, since the
    chat template writes the special tokens itself)."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: for a chat template that reads them
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids (ParamError names a bad field)."""
        if self.prompt is not None and self.messages is not None:
            raise ParamError("messages", "give either prompt or messages, not both")
        if self.messages is None:
            return self._prompt_ids(tokenizer)
        if not self.messages:
            raise ParamError("messages", "messages must not be empty")
        # Validated and shaped as the chat endpoint (prepare_chat) shapes them.
        messages = [m.template_fields(f"messages[{i}]") for i, m in enumerate(self.messages)]
        add_generation_prompt = self.add_generation_prompt is not False
        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt,
                checked_tools(self.tools),
                add_special_tokens=bool(self.add_special_tokens),
            )
        except ValueError as e:  # the chat template's own
            raise ParamError("messages", f"messages: {e}") from None

    def _prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        if self.prompt is None:
            raise ParamError("prompt", "prompt (a string) or messages is required")
        for name in ("add_generation_prompt", "tools"):
            if getattr(self, name) is not None:
                raise ParamError(name, f"{name} applies only with messages")
        if not self.prompt:
            raise ParamError("prompt", "prompt is empty")
        check_text("prompt", self.prompt)
        return tokenizer.encode(
            self.prompt, add_special_tokens=self.add_special_tokens is not False
        )


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text (special tokens included, as vLLM decodes)."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int]

    def text(self, tokenizer: Tokenizer) -> str:
        """The ids' text (ParamError for none, or one outside the tokenizer's vocabulary)."""
        if not self.tokens:
            raise ParamError("tokens", "tokens is empty")
        vocab = tokenizer.vocab_size
        for i, token in enumerate(self.tokens):  # integers: the model is strict
            if not 0 <= token < vocab:
                shown = token if abs(token) < 1 << 64 else "an integer beyond int64"
                raise ParamError("tokens", f"tokens[{i}] is {shown}, outside [0, {vocab})")
        return tokenizer.decode(self.tokens, skip_special_tokens=False)


def install_tokenize_routes(
    app: FastAPI, client: AsyncEngineClient, served_model_name: str
) -> None:
    """Add ``POST /tokenize`` and ``POST /detokenize`` to ``app``, with ``client``'s
    tokenizer. Tokenizing runs in a worker thread, as the completions routes' does, so a
    long text does not hold the event loop."""

    def check(model: str | None) -> None:
        if model is not None:
            check_text("model", model)
        check_model(model, served_model_name)

    async def answer(work):
        try:
            return await asyncio.to_thread(work)
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from e

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The token ids of a text or a chat, their count and the context length."""

        def work() -> dict:
            check(body.model)
            ids = body.token_ids(client.tokenizer)
            strs = (
                client.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
            )
            return {
                "count": len(ids),
                "max_model_len": client.info.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }

        return await answer(work)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids."""

        def work() -> dict:
            check(body.model)
            return {"prompt": body.text(client.tokenizer)}

        return await answer(work)
