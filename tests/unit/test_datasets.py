"""Benchmark datasets: the incremental ShareGPT reader, sampling, MT-Bench and random prompts."""

from __future__ import annotations

import json
import os
from itertools import islice

import pytest

from tandem.bench.datasets import (
    BenchRequest,
    iter_sharegpt,
    load_mtbench,
    load_sharegpt,
    random_requests,
    sharegpt_path,
)


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str) -> list[int]:
        """Fake ids: the words' positions."""
        return list(range(len(text.split())))


def _record(i: int, prompt_words: int, output_words: int, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {
        "id": f"r{i}",
        "conversations": [
            {"from": first, "value": " ".join([f"p{i}"] * prompt_words)},
            {"from": second, "value": " ".join([f"o{i}"] * output_words)},
        ],
    }


def _write_truncated(path: str, records: list[dict], cut_chars: int = 25) -> None:
    """Write records as an indented JSON list, then cut the text inside the last record."""
    text = json.dumps(records, indent=2, ensure_ascii=False)
    last_start = text.rindex('{\n    "id"')
    assert last_start + cut_chars < len(text) - 2
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: last_start + cut_chars])


def test_iter_sharegpt_skips_truncated_tail(tmp_path):
    records = [_record(i, 5 + i, 6 + i) for i in range(20)]
    records[3]["conversations"][0]["value"] = "ünïcödé 🚀 " * 50  # multi-byte text
    path = str(tmp_path / "sg.json")
    _write_truncated(path, records)
    # Tiny chunks force records to span many reads (and split multi-byte characters).
    for chunk_size in (7, 64, 1 << 20):
        got = list(iter_sharegpt(path, chunk_size=chunk_size))
        assert got == records[:-1], chunk_size


def test_iter_sharegpt_complete_and_empty_files(tmp_path):
    records = [_record(i, 5, 5) for i in range(3)]
    full = tmp_path / "full.json"
    full.write_text(json.dumps(records), encoding="utf-8")
    assert list(iter_sharegpt(str(full), chunk_size=5)) == records
    empty = tmp_path / "empty.json"
    empty.write_text("[]", encoding="utf-8")
    assert list(iter_sharegpt(str(empty))) == []
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="JSON list"):
        list(iter_sharegpt(str(bad)))


def test_iter_sharegpt_real_file_head():
    path = sharegpt_path()
    assert os.path.getsize(path) > 100_000_000
    head = list(islice(iter_sharegpt(path), 5))
    assert len(head) == 5
    assert len({r["id"] for r in head}) == 5
    for record in head:
        assert record["conversations"]
        assert all(isinstance(t["value"], str) for t in record["conversations"])
    assert head[0]["conversations"][0]["from"] == "human"


def _mixed_file(tmp_path) -> str:
    records = []
    for i in range(300):
        if i % 10 == 0:
            records.append(_record(i, 2, 20))  # prompt too short
        elif i % 10 == 1:
            records.append(_record(i, 20, 3))  # output too short
        elif i % 10 == 2:
            records.append(_record(i, 200, 20))  # prompt too long
        elif i % 10 == 3:
            records.append(_record(i, 20, 20, first="gpt"))  # no human -> gpt exchange
        else:
            records.append(_record(i, 4 + i % 30, 4 + (i * 7) % 90))
    path = str(tmp_path / "mixed.json")
    _write_truncated(path, records + [_record(999, 5, 5)])
    return path


def test_load_sharegpt_deterministic_per_seed(tmp_path):
    path = _mixed_file(tmp_path)
    tok = WordTokenizer()
    a = load_sharegpt(40, tok, seed=1, max_prompt_len=100, path=path)
    b = load_sharegpt(40, tok, seed=1, max_prompt_len=100, path=path)
    c = load_sharegpt(40, tok, seed=2, max_prompt_len=100, path=path)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 40
    assert all(isinstance(r, BenchRequest) and isinstance(r.prompt, str) for r in a)


def test_load_sharegpt_length_filters(tmp_path):
    path = _mixed_file(tmp_path)
    tok = WordTokenizer()
    reqs = load_sharegpt(
        60, tok, seed=0, max_prompt_len=30, max_total_len=60, max_output_len=50, path=path
    )
    for r in reqs:
        assert r.prompt_len == len(r.prompt.split())
        assert 4 <= r.prompt_len <= 30
        assert 4 <= r.output_len <= 50
        assert r.prompt_len + r.output_len <= 60
        i = int(r.prompt.split()[0][1:])
        assert i % 10 >= 4  # never one of the records that must be dropped
        assert r.output_len == min(4 + (i * 7) % 90, 50)
    assert any(r.output_len == 50 for r in reqs)  # the cap was applied, not a drop


def test_load_sharegpt_not_enough(tmp_path):
    path = _mixed_file(tmp_path)
    with pytest.raises(ValueError, match="only .* of the 1000 requested"):
        load_sharegpt(1000, WordTokenizer(), path=path)
    with pytest.raises(ValueError, match="among 0 records read"):
        load_sharegpt(1, WordTokenizer(), scan_limit=0, path=path)


def test_load_sharegpt_real_file_reads_only_the_head():
    reqs = load_sharegpt(16, WordTokenizer(), seed=0, max_prompt_len=256, max_output_len=64)
    assert len(reqs) == 16
    assert all(4 <= r.prompt_len <= 256 and 4 <= r.output_len <= 64 for r in reqs)
    # A scan limit smaller than the whole file still suffices for a few requests.
    limited = load_sharegpt(16, WordTokenizer(), seed=0, max_prompt_len=256, scan_limit=2000)
    assert len(limited) == 16


def test_mtbench_questions():
    questions = load_mtbench()
    assert len(questions) == 80
    assert len({q["question_id"] for q in questions}) == 80
    for q in questions:
        assert len(q["turns"]) == 2
        assert all(isinstance(t, str) and t for t in q["turns"])
        assert q["category"]


def test_random_requests():
    reqs = random_requests(5, input_len=12, output_len=7, vocab_size=100, seed=3)
    assert len(reqs) == 5
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == 12 == r.prompt_len
        assert r.output_len == 7
        assert all(0 <= t < 100 for t in r.prompt)
    assert reqs == random_requests(5, 12, 7, 100, seed=3)
    assert reqs != random_requests(5, 12, 7, 100, seed=4)
    assert len({tuple(r.prompt) for r in reqs}) == 5
    with pytest.raises(ValueError, match="vocab_size"):
        random_requests(1, 4, 4, 0)
