"""Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Weights are loaded by Hugging Face parameter names (see ``load_weights``); q/k/v and
gate/up projections are fused into one matrix each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.attention import AttentionBackend, AttentionMetadata
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.registry import ModelArchConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.scale = arch.head_dim**-0.5

    def forward(self, positions, hidden, kv_cache, metadata, backend: AttentionBackend):
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Queries and keys rotate in one call: they are adjacent in the fused projection.
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, positions, hidden, kv_cache, metadata, backend):
        hidden = hidden + self.self_attn(
            positions, self.input_layernorm(hidden), kv_cache, metadata, backend
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. ``forward`` returns final-normed hidden states."""

    def __init__(self, arch: ModelArchConfig, max_position: int):
        super().__init__()
        self.arch = arch
        rotary = RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, rotary) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, metadata, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up; checks completeness."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                parts[-2] = target
                name = ".".join(parts)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    self._copy(param, tensor, hf_name)
                else:
                    self._copy(self._shard_view(param, parts[-3], shard), tensor, hf_name)
            loaded.add(f"{name}#{shard}")
        self._check_complete(loaded, params)

    def _shard_view(self, param: torch.Tensor, module: str, shard: int) -> torch.Tensor:
        if module == "mlp":
            size = self.arch.intermediate_size
            return param.narrow(0, shard * size, size)
        q_size = self.arch.num_heads * self.arch.head_dim
        kv_size = self.arch.num_kv_heads * self.arch.head_dim
        offsets = [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)]
        start, size = offsets[shard]
        return param.narrow(0, start, size)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(src)

    def _check_complete(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        expected: set[str] = set()
        for name in params:
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected |= {f"{name}#{i}" for i in range(3)}
            elif name.endswith("gate_up_proj.weight"):
                expected |= {f"{name}#{i}" for i in range(2)}
            elif not (name == "lm_head.weight" and self.arch.tie_word_embeddings):
                expected.add(f"{name}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
