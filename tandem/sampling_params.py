"""Validated sampling parameters, with vLLM's field names."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Every integer a request carries must fit int64 (msgpack and the sampling tensors).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Output lengths and counts beyond this are nonsense for any context.
MAX_COUNT = (1 << 31) - 1
# A nonzero temperature below this divides logits into inf/NaN (denormals do).
MIN_TEMPERATURE = 1e-5
# OpenAI's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# A repetition penalty (vLLM's; 1 is off) divides or multiplies logits: kept in a range
# that cannot turn them into inf or 0.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class ParamError(ValueError):
    """A bad request parameter; ``param`` names the field (the API's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def is_int(value: object) -> bool:
    """True for a real integer (bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> None:
    """Raise ParamError unless ``value`` is an integer in [low, high]."""
    if not is_int(value):
        raise ParamError(name, f"{name} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise ParamError(name, f"{name} must be in [{low}, {high}], got {_shown(value)}")


def check_text(name: str, value: object) -> None:
    """Raise ParamError unless ``value`` is a string of valid Unicode (no lone surrogates)."""
    if not isinstance(value, str):
        raise ParamError(name, f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(name, f"{name} is not valid Unicode (at character {e.start})") from None


GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def check_guided(guided: object) -> None:
    """ParamError unless ``guided`` has the shape of one structured-output constraint
    (``tandem/worker/grammars.py``; compiling it is the worker's)."""
    kinds = ", ".join(GUIDED_KINDS)
    if not isinstance(guided, dict) or len(guided) != 1:
        raise ParamError("guided", f"guided must name exactly one of {kinds}")
    ((kind, spec),) = guided.items()
    if kind not in GUIDED_KINDS:
        raise ParamError("guided", f"guided kind {_shown(kind)} is not one of {kinds}")
    if kind == "json" and not isinstance(spec, (dict, str)):
        raise ParamError("guided", "a json constraint is a JSON schema (an object or its text)")
    if kind == "json_object" and spec is not True:
        raise ParamError("guided", "json_object takes true")
    if kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
        raise ParamError("guided", f"a {kind} constraint is a non-empty string")
    if kind == "choice" and (
        not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec)
    ):
        raise ParamError("guided", "a choice constraint is a list of non-empty strings")


def _finite_float(name: str, value: object) -> float:
    """``value`` as a float; ParamError unless it is a finite number."""
    if not is_int(value) and not isinstance(value, float):
        raise ParamError(name, f"{name} must be a number, got {_shown(value)}")
    if is_int(value) and abs(value) > 1 << 64:
        raise ParamError(name, f"{name} must be finite, got {_shown(value)}")
    if not math.isfinite(float(value)):
        raise ParamError(name, f"{name} must be finite, got {_shown(value)}")
    return float(value)


def _shown(value: object) -> str:
    """A short repr for messages (a huge list or int stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k.
    ``logprobs=N`` returns the N most likely tokens per generated token, plus the sampled
    token's own logprob, which is always present; ``logprobs=0`` returns only the latter.
    ``logit_bias`` (token id -> bias) and the penalties change the logits a token is
    chosen from (greedy too), as vLLM applies them: the bias first, then the repetition
    penalty over the prompt's and the output's tokens, then frequency and presence over the
    output's; logprobs stay the raw ones.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Structured output: one constraint on the output (``check_guided``), or None.
    guided: dict | None = None
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
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ParamError(name, f"{name} must be a list, got {type(value).__name__}")
            setattr(self, name, list(value or []))
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ParamError("logit_bias", "logit_bias must be a map of token ids to numbers")
        self._validate()

    def _validate(self) -> None:
        """Bounds that hold for every model; :meth:`validate_for_vocab` adds the vocabulary."""

        def fail(name: str, why: str) -> None:
            raise ParamError(name, f"{name} {why}, got {_shown(getattr(self, name))}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, _finite_float(name, getattr(self, name)))
        if self.temperature != 0 and not self.temperature >= MIN_TEMPERATURE:
            fail("temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        self._validate_penalties()
        if self.guided is not None:
            check_guided(self.guided)
            if self.min_tokens:  # the end-token ban could leave a complete output no token
                fail("min_tokens", "must be 0 with a structured-output constraint")
        check_int("top_k", self.top_k, -1)
        if self.seed is not None:
            check_int("seed", self.seed)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, MAX_COUNT)
        check_int("min_tokens", self.min_tokens, 0, MAX_COUNT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        self._validate_lists()

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ParamError(
                    name, f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {_shown(value)}"
                )
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be in [{low}, {high}],"
                f" got {_shown(self.repetition_penalty)}",
            )

    def _validate_lists(self) -> None:
        for stop in self.stop:
            check_text("stop", stop)
            if not stop:
                raise ParamError("stop", f"stop must hold non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, 0)
        for token_id in self.eos_token_ids:
            check_int("eos_token_ids", token_id, 0)
        if self.logit_bias is not None:
            bias = {}
            for token_id, value in self.logit_bias.items():
                check_int("logit_bias", token_id, 0)
                value = _finite_float("logit_bias", value)
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ParamError(
                        "logit_bias",
                        f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}],"
                        f" got {_shown(value)} for token {token_id}",
                    )
                bias[token_id] = value
            self.logit_bias = bias or None

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ParamError if a token id (stop or end token) is outside the vocabulary."""
        for name in ("stop_token_ids", "eos_token_ids", "logit_bias"):
            bad = sorted(t for t in getattr(self, name) or () if t >= vocab_size)
            if bad:
                raise ParamError(name, f"{name} outside [0, {vocab_size}): {_shown(bad[:5])}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """True when a logit bias or a penalty changes the logits tokens are chosen from."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def reads_output(self) -> bool:
        """True when choosing a token reads the output so far (a bias or penalty, or a
        structured-output constraint): such a row is decoded on the host-read path."""
        return self.adjusts_logits or self.guided is not None

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
        # Pairs, not a map: message maps keep string keys only.
        data["logit_bias"] = sorted(self.logit_bias.items()) if self.logit_bias else None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        """Validated parameters from :meth:`to_dict`'s data (ValueError names a bad field,
        TypeError an unknown one)."""
        data = dict(data)
        data["eos_token_ids"] = frozenset(data.get("eos_token_ids") or ())
        bias = data.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, (list, tuple)) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and is_int(pair[0])
                for pair in bias
            ):
                raise ParamError("logit_bias", "logit_bias must be a list of (token, bias) pairs")
            data["logit_bias"] = dict(bias)
        return cls(**data)
