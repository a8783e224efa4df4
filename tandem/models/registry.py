"""Model architectures Tandem runs, their shape config, and named presets for dummy weights."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",  # Qwen2-shaped, with MTP layers beside it
}


@dataclass(frozen=True)
class ModelArchConfig:
    """The shape of a Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArchConfig:
        """Read a Hugging Face config.json dict."""
        architectures = config.get("architectures") or []
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ValueError(
                f"unsupported architectures {architectures}; "
                f"Tandem runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[known[0]]
        num_heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
        rope_theta = config.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        return cls(
            architecture=known[0],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rope_theta=float(rope_theta or 10000.0),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=_rope_scaling(rope_scaling),
        )

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict of this shape (``from_hf_config``'s inverse)."""
        config = {
            "architectures": [self.architecture],
            "model_type": SUPPORTED_ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config


def _rope_scaling(raw: dict | None) -> dict | None:
    """Keep a rope scaling entry only if it changes anything; reject kinds we don't run."""
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
    return dict(raw)


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DUMMY_PRESETS: dict[str, ModelArchConfig] = {
    "smollm2-135m": ModelArchConfig(
        "LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192, True
    ),
    "llama3-8b": ModelArchConfig(
        "LlamaForCausalLM",
        128256,
        4096,
        14336,
        32,
        32,
        8,
        128,
        500000.0,
        1e-5,
        8192,
        rope_scaling=_LLAMA3_SCALING,
    ),
    "qwen3-8b": ModelArchConfig(
        "Qwen3ForCausalLM",
        151936,
        4096,
        12288,
        36,
        32,
        8,
        128,
        1000000.0,
        1e-6,
        40960,
        qk_norm=True,
    ),
    # A tiny shape for tests and quick checks.
    "tiny": ModelArchConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 10000.0, 1e-5, 1024),
}


# A dummy model name ending in this gets weights whose greedy choices are far from ties
# (``tandem.models.loader``): same architecture, same compute.
PEAKED_SUFFIX = "-peaked"


def dummy_preset(name: str) -> ModelArchConfig:
    """The architecture of a named dummy model (random weights); ``NAME-peaked`` is NAME's."""
    base = name.removesuffix(PEAKED_SUFFIX)
    if base not in DUMMY_PRESETS:
        raise ValueError(
            f"unknown dummy model {name!r}; choose one of {sorted(DUMMY_PRESETS)}, "
            f"each also as NAME{PEAKED_SUFFIX}"
        )
    return replace(DUMMY_PRESETS[base])
