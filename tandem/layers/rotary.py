"""Rotary position embedding (HF's rotate-half layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from tandem.layers.fused_rotary import rotary, rotary_store_kv


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for each pair of dimensions, in fp32."""
    # fp32 throughout, as the reference implementation computes it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self._shape = (head_dim, max_position, theta, scaling)
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_position, theta, scaling = self._shape
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        return freqs.cos(), freqs.sin()

    def fill_tables(self) -> None:
        """Compute the tables again into the buffers (after ``to_empty`` left them unset), on
        their device, as the constructor would have there."""
        with torch.device(self.cos.device):
            cos, sin = self._tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (queries and keys of any number of heads) by positions [T]."""
        return rotary(x, positions, self.cos, self.sin)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_q_heads: int,
    ) -> torch.Tensor:
        """Rotate queries and keys (``qk`` [T, H_q + H_kv, D]), write the rotated keys and
        ``v`` into their cache slots, and return the rotated queries [T, H_q, D]."""
        return rotary_store_kv(
            qk, v, positions, self.cos, self.sin, k_cache, v_cache, slot_mapping, num_q_heads
        )
