"""Structured output: grammars that constrain which tokens a request may emit (xgrammar,
as vLLM and SGLang use it).

A request's ``SamplingParams.guided`` names one constraint: ``{"json": schema}`` (a JSON
schema, as a dict or its text), ``{"json_object": True}`` (any JSON object),
``{"regex": pattern}``, ``{"choice": [texts]}`` or ``{"grammar": ebnf}``. The worker
compiles it once per distinct constraint (``GrammarBook``), keeps a matcher per request fed
with the request's output tokens, and before each step computes the token bitmask of every
position the row decides: the next token's, and with MTP drafts the one after each draft the
matcher accepts (the matcher then rolls back). A draft the grammar forbids is masked at its
own position, so verification rejects it; positions after it decide nothing. The masks are
applied to the logits a token is chosen from (``step_sampler``); logprobs stay raw.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from tandem.device_copy import DeviceReader
from tandem.sampling_params import ParamError


def advance(matcher: Any, tokens: list[int]) -> None:
    """Feed ``tokens`` of a request's output to its matcher, up to an end token the matcher
    took: what follows it is not output (an accepted run's rest, or a row launched before the
    end was read: the request has ended and the row is dropped). ValueError if the grammar
    refuses one (the masks make that impossible)."""
    for token in tokens:
        if matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            raise ValueError(f"the output breaks its grammar at token {token}")


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks (bit j of word w: token 32 w + j) -> [R, vocab_size] bool."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarBook:
    """Compiled grammars of one tokenizer (cached by constraint) and their matchers."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, end_token_ids: list[int]):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        # The model's own end tokens (as the engine reads them), not xgrammar's guess from
        # the tokenizer (which depends on the transformers version: under transformers 5 it
        # took <|im_start|> for SmolLM2's end, and a complete output could not stop).
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=end_token_ids
        )
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self._compiled: dict[str, Any] = {}
        self._stop_only = torch.zeros(-(-vocab_size // 32), dtype=torch.int32)
        for token in self.info.stop_token_ids:
            self._stop_only[token // 32] |= 1 << (token % 32)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> GrammarBook:
        """The book of a Tandem ``Tokenizer``, ending on its model's end tokens."""
        return cls(tokenizer.hf, vocab_size, sorted(tokenizer.end_token_ids))

    def compile(self, guided: dict) -> Any:
        """The compiled grammar of ``guided`` (ParamError naming ``guided`` if it does not
        compile); ``guided`` has the shape ``check_guided`` checks (SamplingParams did)."""
        key = json.dumps(guided, sort_keys=True)
        if key not in self._compiled:
            ((kind, spec),) = guided.items()
            try:
                self._compiled[key] = self._compile(kind, spec)
            except Exception as exc:  # xgrammar raises its own errors on bad input
                raise ParamError(
                    "guided", f"the {kind} constraint does not compile: {exc}"
                ) from None
        return self._compiled[key]

    def _compile(self, kind: str, spec: Any) -> Any:
        # JSON without free whitespace (", " and ": " between items): a model that likes
        # newlines cannot fill its budget with them.
        if kind == "json":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            return self.compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            return self.compiler.compile_regex("|".join(re.escape(c) for c in spec))
        return self.compiler.compile_grammar(spec)

    def matcher(self, guided: dict, output_ids: list[int]) -> Any:
        """A matcher of ``guided`` that has accepted ``output_ids``."""
        matcher = self._xgr.GrammarMatcher(self.compile(guided))
        advance(matcher, output_ids)
        return matcher

    def masks(self, matcher: Any, drafts: list[int]) -> torch.Tensor:
        """[1 + len(drafts), W] int32 bitmasks: the next token's, then after each draft the
        matcher accepts (the rest allow every token); the matcher ends where it began."""
        masks = self._xgr.allocate_token_bitmask(1 + len(drafts), self.vocab_size)
        accepted = 0
        for j in range(1 + len(drafts)):
            if matcher.is_terminated():  # complete (an end token taken): only an end token
                masks[j] = self._stop_only
                break
            matcher.fill_next_token_bitmask(masks, j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return masks


class RowGrammars:
    """The step pipeline's side of structured output: checks a request's constraint at
    admission, and at a row's launch brings its matcher up to the row's output and computes
    its masks. The grammar book is built at the first constrained request (from the model's
    tokenizer)."""

    def __init__(self, model_path: str | None, vocab_size: int, reader: DeviceReader):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.reader = reader  # reads constrained rows' drafts (a counted wait)
        self._book: GrammarBook | None = None

    @property
    def book(self) -> GrammarBook:
        if self._book is None:
            from tandem.models.loader import resolve_model
            from tandem.tokenizer import Tokenizer

            path = resolve_model(self.model_path)
            if path.startswith("dummy:"):
                raise ParamError("guided", "structured output needs the model's own tokenizer")
            self._book = GrammarBook.of(Tokenizer.from_model_path(path), self.vocab_size)
        return self._book

    def check(self, params: Any) -> None:
        """ParamError if ``params``' constraint (if any) does not compile here."""
        if params.guided is not None:
            self.book.compile(params.guided)

    def read_drafts(self, plans: list, batch: Any) -> dict[int, list[int]]:
        """The drafts each constrained row of ``plans`` verifies, on the host (by
        ``id(plan)``), read in one wait through the reader: the one wait a step takes
        beyond DESIGN.md's one per step, and only with MTP and a constrained row."""
        rows = [
            p for p in plans if p.num_drafts and p.row.request.sampling_params.guided is not None
        ]
        if not rows:
            return {}
        drafts = [batch.drafts_of(p.state)[: p.num_drafts] for p in rows]
        host = self.reader.read(self.reader.start(drafts))
        return {id(plan): drafts for plan, drafts in zip(rows, host, strict=True)}

    def masks(self, plan: Any, params: Any, end: int, drafts: list[int]) -> torch.Tensor | None:
        """The bitmasks of a row (``plan``) whose first drawn position is ``end`` (its
        output before it known to the host) verifying ``drafts`` (``read_drafts``); None
        without a constraint."""
        if params.guided is None:
            return None
        state = plan.state
        output = state.token_ids[state.num_prompt_tokens : end]
        if state.matcher is None or state.matcher_len > len(output):
            state.matcher, state.matcher_len = self.book.matcher(params.guided, output), len(output)
        advance(state.matcher, output[state.matcher_len :])
        state.matcher_len = len(output)
        return self.book.masks(state.matcher, drafts)
