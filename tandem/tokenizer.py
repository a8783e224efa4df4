"""Tokenizer wrapper, incremental (streaming) detokenization and stop-string matching."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from tokenizers.decoders import DecodeStream

from tandem import tokenizer_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many trailing prompt tokens give the streaming decoder its context (enough for
# decoders such as SentencePiece's Metaspace, which treat the first token specially).
_PROMPT_CONTEXT_TOKENS = 6
# GGUF metadata keys holding token ids that also end generation, besides the EOS token.
_GGUF_END_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _read_gguf_metadata(path: str) -> dict[str, Any]:
    """Return the scalar ``tokenizer.ggml.*`` token-id metadata of a GGUF file."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises many types on truncated/corrupt files
        raise ValueError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    meta: dict[str, Any] = {}
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", *_GGUF_END_KEYS):
        field = reader.fields.get(key)
        if field is not None:
            meta[key] = int(field.contents())
    return meta


def _convert_gguf(path: str) -> tuple[PreTrainedTokenizerBase, dict[str, Any]]:
    """The fast tokenizer and token-id metadata of a GGUF file, converted (and cached)."""
    from transformers import AutoTokenizer

    meta = _read_gguf_metadata(path)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        hf = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as exc:
        raise ValueError(f"{path}: cannot load tokenizer from GGUF ({exc})") from exc
    tokenizer_cache.save(path, hf, meta)
    return hf, meta


def _read_generation_eos(directory: str) -> list[int]:
    """Return the ``eos_token_id`` entries (int or list) of generation_config.json, if any."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read generation config ({exc})") from exc
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


class Tokenizer:
    """A Hugging Face fast tokenizer plus the end-of-generation token ids of its model."""

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        eos_token_id: int,
        extra_end_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError("hf_tokenizer: a fast (tokenizers-backed) tokenizer is required")
        self._hf = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        self.eos_token_id: int = eos_token_id
        bos = hf_tokenizer.bos_token_id
        self.bos_token_id: int | None = bos if isinstance(bos, int) else None
        self.end_token_ids: frozenset[int] = frozenset({eos_token_id, *extra_end_token_ids})

    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """Load the tokenizer of a ``.gguf`` file or of a Hugging Face model directory."""
        from transformers import AutoTokenizer

        if os.path.isdir(path):
            end_ids = _read_generation_eos(path)
            try:
                hf = AutoTokenizer.from_pretrained(path)
            except Exception as exc:
                raise ValueError(f"{path}: cannot load tokenizer ({exc})") from exc
            eos = hf.eos_token_id if hf.eos_token_id is not None else next(iter(end_ids), None)
        elif os.path.isfile(path):
            hf, meta = tokenizer_cache.load(path) or _convert_gguf(path)
            end_ids = [int(meta[k]) for k in _GGUF_END_KEYS if k in meta]
            eos = meta.get("tokenizer.ggml.eos_token_id", hf.eos_token_id)
        else:
            raise ValueError(f"{path}: model path does not exist")
        if eos is None:
            raise ValueError(f"{path}: the tokenizer defines no eos_token_id")
        return cls(hf, int(eos), frozenset(end_ids))

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The underlying transformers tokenizer."""
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token markup in the text is recognised)."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (no tokenization-space clean-up, matching streaming output)."""
        return self._hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def decode_token(self, token_id: int) -> str:
        """Text of one token on its own (special tokens included), e.g. for logprobs."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id: {token_id} is outside [0, {self.vocab_size})")
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render ``messages`` (and ``tools``, the functions the model may call, for a
        template that reads them) with the model's chat template and return the prompt ids
        (``add_special_tokens``: the tokenizer's own BOS/EOS around the rendered text too, as
        vLLM's ``/tokenize`` may ask; the chat endpoint never does). A template that refuses
        the messages (its ``raise_exception``) raises ValueError."""
        if not getattr(self._hf, "chat_template", None):
            raise ValueError("chat_template: this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages
        ):
            raise ValueError("messages: expected a list of dicts, each with a 'role' key")
        try:
            text = self._hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as e:  # the template's own raise_exception, or a broken one
            raise ValueError(f"chat template: {e}") from None
        # The template already writes any BOS/markup tokens itself.
        return self.encode(text, add_special_tokens=add_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never emitting a partial UTF-8 character.

    Built on ``tokenizers.decoders.DecodeStream``, primed with the last few prompt tokens so
    that the first generated token is decoded as it would be in context.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.hf.backend_tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def append(self, token_ids: list[int]) -> str:
        """Add newly generated tokens; return the text they complete (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        delta = "".join(pieces)
        self._text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back any tail that may start one.

    When several stop strings occur, the one that is complete first in the text wins (ties:
    the one starting first), so the result does not depend on how the text was chunked.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop: every stop string must be a non-empty str")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the matched stop string or None).

        After a match, the emitted text ends at the stop string (before it, or after it
        with ``include_stop_str_in_output``); later calls return ``("", matched)``.
        """
        if self.matched is not None:
            return "", self.matched
        if not self._stop:
            return delta, None
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, s = best
            self.matched = s
            self._held = ""
            return text[: end if self._include else start], s
        hold = 0
        for k in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                hold = k
                break
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Return the held-back text at the end of generation ("" after a match)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
