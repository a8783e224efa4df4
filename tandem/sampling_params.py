"""Validated sampling parameters, with vLLM's field names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k.
    ``logprobs=N`` returns the N most likely tokens per generated token, plus the sampled
    token's own logprob, which is always present; ``logprobs=0`` returns only the latter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # End tokens of the model (EOS and friends), filled in by the engine.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                fail(name, f"must be in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    def end_token_ids(self) -> set[int]:
        """Token ids that finish the request (after min_tokens)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def to_dict(self) -> dict:
        """Plain data for a message between processes (see :meth:`from_dict`)."""
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = sorted(self.eos_token_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Validated parameters from :meth:`to_dict`'s data (ValueError names a bad field,
        TypeError an unknown one)."""
        data = dict(data)
        data["eos_token_ids"] = frozenset(data.get("eos_token_ids") or ())
        return cls(**data)
