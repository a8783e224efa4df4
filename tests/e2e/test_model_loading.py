"""Model loading: Hugging Face directories (Llama, Qwen2, Qwen3) give HF's greedy tokens and
logprobs, ``dummy:NAME`` presets load, and bad model paths fail with a ValueError that names
what is wrong.

The HF checks use tiny random models built here with transformers and saved in fp32 with
safetensors. Their vocabulary is the default model's, so its tokenizer (saved once to a
directory, since converting the GGUF tokenizer takes seconds) serves as ``tokenizer=``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench.hf_reference import hf_greedy_generate, load_hf_model, tie_rule_mismatches
from tandem.models.loader import default_model_path

TOLERANCE = 1e-4
MAX_NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 40, 70)
VOCAB = 49152  # the default model's (SmolLM2) vocabulary
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "initializer_range": 0.2,  # large enough that logits are not flat
    # No end token at all: HF then generates every one of the max_new_tokens.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama-untied": ("LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama3-rope-tied": (
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 512},
    ),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # head_dim 32 != hidden_size / heads: the q/o projections are wider than the model.
    "qwen3-untied": ("Qwen3ForCausalLM", {"tie_word_embeddings": False, "head_dim": 32}),
}


def build_hf_model(architecture: str, seed: int = 0, vocab_size: int = VOCAB, **overrides):
    """A tiny random transformers model; biases and norm weights are random too, so that
    loading them wrongly (or not at all) shows in the outputs."""
    import transformers

    model_type = architecture.removesuffix("ForCausalLM")
    config_class = getattr(transformers, f"{model_type}Config")
    model_class = getattr(transformers, architecture)
    config = config_class(**{**SHAPE, "vocab_size": vocab_size, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def save_hf_model(model, directory) -> str:
    model.save_pretrained(str(directory))
    assert os.path.exists(os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f).get("dtype", "float32") == "float32"
    return str(directory)


def random_prompts(seed: int, lengths=PROMPT_LENGTHS, vocab_size: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


DUMMY_KWARGS = {"model": "dummy:tiny", "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def dummy_llm(cached_llm) -> LLM:
    """``dummy:tiny``, built once and shared with make_llm's engines."""
    return cached_llm(**DUMMY_KWARGS)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, dummy_llm) -> str:
    """The default model's tokenizer (which a dummy model borrows), saved as a Hugging Face
    directory."""
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    dummy_llm.tokenizer.hf.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A small untied Llama checkpoint for the error cases (its vocabulary is small)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = build_hf_model("LlamaForCausalLM", vocab_size=256, tie_word_embeddings=False)
    return save_hf_model(model, directory)


def assert_matches_hf(outputs, references) -> int:
    """Every reference has all MAX_NEW_TOKENS tokens, every output has logprobs, and the tie
    rule holds (see tie_rule_mismatches). Returns the number of ties."""
    for output, ref in zip(outputs, references, strict=True):
        completion = output.outputs[0]
        assert len(ref["token_ids"]) == MAX_NEW_TOKENS, f"HF generated {len(ref['token_ids'])}"
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
    problems, ties = tie_rule_mismatches(outputs, references, TOLERANCE)
    assert not problems, problems
    return ties


# ---- Hugging Face directories match transformers ------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_hf_directory_matches_transformers(case, tmp_path, make_llm, tokenizer_dir):
    architecture, overrides = CASES[case]
    seed = list(CASES).index(case)
    model_dir = save_hf_model(build_hf_model(architecture, seed, **overrides), tmp_path / case)
    hf = load_hf_model(model_dir)
    prompts = random_prompts(seed)
    references = hf_greedy_generate(hf, prompts, MAX_NEW_TOKENS, eos_token_ids=[])

    llm = make_llm(model=model_dir, tokenizer=tokenizer_dir, num_kv_blocks=64)
    arch = llm.engine.arch
    assert arch.architecture == architecture
    assert arch.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert (arch.rope_scaling is not None) == ("rope_scaling" in overrides)
    assert arch.head_dim == overrides.get("head_dim", 16)

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    for output in outputs:
        assert output.finished and output.outputs[0].finish_reason == "length"
    ties = assert_matches_hf(outputs, references)
    assert ties <= 1, f"{ties} ties in {len(prompts)} prompts of a random model is implausible"

    # Prompt logprobs: position i + 1's token under the logits at i of a plain forward pass.
    prompt = prompts[2]
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = logits.log_softmax(dim=-1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i in range(len(prompt) - 1):
        entry = got[i + 1]
        token = prompt[i + 1]
        assert token in entry, f"position {i + 1}: the prompt token is missing"
        want = expected[i, token].item()
        assert abs(entry[token].logprob - want) < TOLERANCE, (
            f"prompt logprob at {i + 1}: {entry[token].logprob} vs {want}"
        )
        best = max(lp.logprob for lp in entry.values())
        assert abs(best - expected[i].max().item()) < TOLERANCE, f"top-1 at {i + 1}"


def test_hf_greedy_generate_empty_eos_list_means_no_end_token():
    """``eos_token_ids=[]`` asks for no end token, so every one of max_new_tokens comes back,
    even when the model's own generation config names an end token that greedy picks."""
    model = build_hf_model("LlamaForCausalLM", vocab_size=256, tie_word_embeddings=False)
    prompt = [[5, 6, 7, 8, 9]]
    free = hf_greedy_generate(model, prompt, 4, eos_token_ids=None)[0]["token_ids"]
    assert len(free) == 4
    model.generation_config.eos_token_id = free[1]
    assert hf_greedy_generate(model, prompt, 4, eos_token_ids=None)[0]["token_ids"] == free[:2]
    assert hf_greedy_generate(model, prompt, 4, eos_token_ids=[])[0]["token_ids"] == free


# ---- dummy presets -------------------------------------------------------------------------


def test_dummy_tiny_loads_and_generates(make_llm):
    llm = make_llm(**DUMMY_KWARGS)
    assert llm.model_path == "dummy:tiny" and llm.engine.arch.vocab_size == 512
    # A dummy model borrows the default model's tokenizer.
    assert llm.tokenizer.vocab_size == VOCAB
    prompt = [1, 17, 200, 311, 42, 511, 0, 99]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params)
    completion = output.outputs[0]
    assert output.prompt_token_ids == prompt
    assert len(completion.token_ids) == 12
    assert completion.finish_reason == "length"
    assert all(0 <= t < 512 for t in completion.token_ids)


def test_unknown_dummy_preset_is_rejected():
    with pytest.raises(ValueError, match="nope"):
        LLM(model="dummy:nope")


# ---- errors --------------------------------------------------------------------------------


def _assert_load_fails(model: str, *needles: str) -> None:
    with pytest.raises(ValueError) as info:
        LLM(model=model, num_kv_blocks=8)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_missing_path(tmp_path):
    path = str(tmp_path / "no-such-model")
    _assert_load_fails(path, path)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    _assert_load_fails(str(tmp_path), str(tmp_path), "config.json")


def test_unsupported_architecture(tmp_path):
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    _assert_load_fails(str(tmp_path), "GPT2LMHeadModel")


def test_directory_without_safetensors(tmp_path, tiny_llama_dir):
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), tmp_path / "config.json")
    _assert_load_fails(str(tmp_path), str(tmp_path), "safetensors")


@pytest.mark.parametrize(
    "missing", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"]
)
def test_checkpoint_missing_a_tensor(missing, tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    del weights[missing]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), tmp_path / "config.json")
    # The name as the checkpoint spells it (the "model." prefix may be dropped).
    _assert_load_fails(str(tmp_path), missing.removeprefix("model."))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(
        torch.randint(
            0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        .numpy()
        .tobytes()
    )
    _assert_load_fails(str(path), str(path))


def test_truncated_gguf(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(2 * 2**20))
    _assert_load_fails(str(path), str(path))


def test_not_a_gguf_file(tmp_path, tiny_llama_dir):
    path = tmp_path / "model.safetensors"
    shutil.copy(os.path.join(tiny_llama_dir, "model.safetensors"), path)
    _assert_load_fails(str(path), str(path), ".gguf")
