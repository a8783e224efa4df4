"""Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Weights are loaded by Hugging Face parameter names (see ``load_weights``); q/k/v and
gate/up projections are fused into one matrix each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tandem.layers.attention import AttentionBackend, AttentionMetadata
from tandem.layers.fused import rms_norm, silu_mul
from tandem.layers.rotary import RotaryEmbedding
from tandem.layers.skinny_linear import MAX_WIDTH, linear, norm_linear, norm_linear_applies
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.registry import ModelArchConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight. Given a
    ``residual``, it normalizes ``x + residual`` and returns (normed, the sum): one fused
    kernel on CUDA."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


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
        return self.attend(positions, self.qkv_proj(hidden), kv_cache, metadata, backend)

    def attend(
        self, positions, qkv, kv_cache, metadata, backend: AttentionBackend, qkv_from_triton=False
    ):
        """The attention block from its fused q/k/v projection ``qkv`` on: rotation, the
        cache, attention and ``o_proj`` (``qkv_from_triton``: a Triton kernel projected
        ``qkv``, which the attention's launch may overlap)."""
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Queries and keys rotate in one call: they are adjacent in the fused projection.
        if backend.attends_cache:  # the rotation also stores the keys and values
            out = backend.attend_rotating(
                qk,
                v,
                positions,
                self.rotary,
                *kv_cache,
                metadata,
                self.scale,
                self.num_heads,
                after_triton=qkv_from_triton and self.q_norm is None,
            )
        else:
            q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        out = out.reshape(-1, self.q_size)
        if qkv_from_triton and self.projects_after_triton(backend):
            return linear(out, self.o_proj.weight, self.o_proj.bias, after_triton=True)
        return self.o_proj(out)

    def projects_after_triton(self, backend: AttentionBackend) -> bool:
        """Whether, on the fused path of a few rows, the output projection is a Triton GEMM
        launched with PDL after the attention's Triton kernels (``skinny_linear.linear``;
        it takes ``F.linear`` itself where its kernel does not apply): a plain linear layer
        (not a rank's shard under tensor parallelism) no wider than the kernel takes, after
        the Triton backend."""
        return (
            type(self.o_proj) is nn.Linear
            and self.q_size <= MAX_WIDTH
            and isinstance(backend, TritonAttentionBackend)
        )


class MLP(nn.Module):
    """SwiGLU MLP. Gate and up load as two matrices (on the CPU two half-width matmuls beat
    one fused); ``fuse_gate_up`` joins them for the GPU, where one GEMM reads the weights
    faster than two and the fused SwiGLU kernel reads the halves in place."""

    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_gate_up(self) -> None:
        """Replace ``gate_proj`` and ``up_proj`` by one ``gate_up_proj`` (rows: gate, then up).
        Apply after loading and tensor-parallel sharding; the weights are not trained after."""
        gate, up = self.gate_proj, self.up_proj
        fused = nn.Linear(
            gate.in_features,
            gate.out_features + up.out_features,
            bias=False,
            device=gate.weight.device,
            dtype=gate.weight.dtype,
        )
        with torch.no_grad():
            fused.weight.copy_(torch.cat([gate.weight, up.weight]))
        self.gate_up_proj = fused.requires_grad_(False)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, positions, hidden, kv_cache, metadata, backend, residual=None):
        """(MLP output, residual): the layer's output is their sum, left for the next
        norm to add in its kernel. Given ``residual``, the input is ``hidden + residual``
        (added inside the first norm). At a few rows on the GPU each norm runs inside the
        projection after it, and SiLU-and-multiply in the gate-up projection's epilogue
        (:mod:`tandem.layers.skinny_linear`)."""
        if self._norms_in_projections(hidden):
            return self._forward_norms_in_projections(
                positions, hidden, kv_cache, metadata, backend, residual
            )
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual=residual)
        attended = self.self_attn(positions, normed, kv_cache, metadata, backend)
        normed, residual = self.post_attention_layernorm(attended, residual=residual)
        return self.mlp(normed), residual

    def _norms_in_projections(self, hidden: torch.Tensor) -> bool:
        """The norm-and-projection kernels apply: q/k/v and the fused gate-up matrix plain
        linear layers (under tensor parallelism too: each rank's rows, the input whole),
        ``hidden`` few and narrow enough rows on the GPU."""
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        if gate_up is None or not all(type(m) is nn.Linear for m in (qkv, gate_up)):
            return False
        return norm_linear_applies(hidden, qkv.weight, gate_up.weight)

    def _forward_norms_in_projections(
        self, positions, hidden, kv_cache, metadata, backend, residual
    ):
        norm, qkv_proj = self.input_layernorm, self.self_attn.qkv_proj
        qkv = norm_linear(hidden, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias, residual)
        if residual is None:
            residual = hidden
        else:
            qkv, residual = qkv
        attended = self.self_attn.attend(
            positions, qkv, kv_cache, metadata, backend, qkv_from_triton=True
        )
        norm = self.post_attention_layernorm
        gated, residual = norm_linear(
            attended,
            norm.weight,
            norm.eps,
            self.mlp.gate_up_proj.weight,
            residual=residual,
            gated=True,
            after_triton=self.self_attn.projects_after_triton(backend),
        )
        return self.mlp.down_proj(gated), residual


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
        self.draft_features: tuple[tuple[int, ...], object] | None = None

    def materialize(self, device: torch.device) -> LlamaModel:
        """This model, built on the meta device, given storage on ``device``: parameters
        left unset for the caller to fill, the rotary tables computed, the LM head tied to
        the embedding again (``to_empty`` unties it)."""
        self.to_empty(device=device)
        self.rotary.fill_tables()
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H]; with draft features attached
        (``attach_draft_features``), [T, 2H]: the draft head's fused features after them."""
        layers, fuse = self.draft_features or ((), None)
        hidden, states = self.forward_states(
            input_ids, positions, kv_caches, metadata, backend, layers
        )
        return hidden if fuse is None else torch.cat([hidden, fuse(states)], dim=-1)

    def forward_states(self, input_ids, positions, kv_caches, metadata, backend, layers=()):
        """Final-normed hidden states and the residual stream after each of ``layers``
        (increasing indices of decoder layers; the last layer's is the final norm's sum)."""
        hidden = self.embed_tokens(input_ids)
        residual = None  # every residual add happens inside a norm's kernel
        states = []
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(positions, hidden, kv_cache, metadata, backend, residual)
            if index in layers and index != last:
                states.append(hidden + residual)
        normed, summed = self.norm(hidden, residual=residual)
        return normed, (states + [summed] if last in layers else states)

    def attach_draft_features(self, layers: tuple[int, ...], fuse) -> None:
        """Make ``forward`` also return ``fuse(states)`` of the residual stream after
        ``layers`` (checked where the head loads): the input an MTP head with fused base
        features drafts from (``MTPHead.feature_layers``, EAGLE-3's low, middle and high
        layers)."""
        self.draft_features = (tuple(layers), fuse)

    def fuse_gate_up(self) -> None:
        """Every layer's MLP with one gate-up matrix (``MLP.fuse_gate_up``)."""
        for layer in self.layers:
            layer.mlp.fuse_gate_up()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states (of ``forward``'s output: its first H columns)."""
        return self.model_dtype_logits(hidden).float()

    def model_dtype_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` before its fp32 copy, in the weights' dtype. Enough for an
        argmax, which it gives exactly: widening bf16 or fp16 to fp32 is exact and keeps
        the order, and argmax takes the first of tied maxima either way. One kernel and a
        pass over the vocabulary fewer for greedy choices."""
        return self.lm_head(hidden[..., : self.arch.hidden_size])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (``model.`` prefix optional)."""

        def renamed():
            for hf_name, tensor in weights:
                name = hf_name.removeprefix("model.")
                if (
                    "rotary_emb" in name
                    or (name == "lm_head.weight" and self.arch.tie_word_embeddings)
                    or self._is_mtp_weight(name)
                ):
                    continue
                yield name, tensor

        load_fused_weights(self, self.arch, renamed())

    def _is_mtp_weight(self, name: str) -> bool:
        """MTP layers stored beside the target's (MiMo, DeepSeek-V3): loaded by the head."""
        if name.startswith("mtp_layers."):
            return True
        parts = name.split(".")
        return parts[0] == "layers" and int(parts[1]) >= self.arch.num_layers


_QKV = ("q_proj", "k_proj", "v_proj")


def load_fused_weights(
    module: nn.Module, arch: ModelArchConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy tensors named like ``module``'s parameters, except that q/k/v projections come
    separately (``q_proj``/``k_proj``/``v_proj``) and land in the fused ``qkv_proj``.
    Raises ValueError naming any unexpected, misshapen or missing weight."""
    params = dict(module.named_parameters())
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    qkv_slices = [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)]
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for index, proj in enumerate(_QKV):
            if f".{proj}." in name:
                target, shard = name.replace(proj, "qkv_proj"), index
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} for {arch.architecture}")
        param = params[target]
        if shard is not None:
            param = param.narrow(0, *qkv_slices[shard])
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    expected: set[str] = set()
    for name in params:
        if "qkv_proj" in name:
            expected |= {name.replace("qkv_proj", proj) for proj in _QKV}
        elif not (name == "lm_head.weight" and arch.tie_word_embeddings):
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")


def split_fused_weights(module: nn.Module, arch: ModelArchConfig) -> dict[str, torch.Tensor]:
    """The inverse of ``load_fused_weights``: fp32 CPU tensors with q/k/v split again (and
    gate/up, where ``MLP.fuse_gate_up`` joined them)."""
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        tensor = param.detach().float().cpu().contiguous()
        if "qkv_proj" in name:
            pieces = tensor.split([q_size, kv_size, kv_size], dim=0)
            for proj, piece in zip(_QKV, pieces, strict=True):
                out[name.replace("qkv_proj", proj)] = piece.contiguous()
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = tensor
    return out
