"""MTP (multi-token prediction) draft head, DeepSeek-V3 style.

One MTP layer at position p turns the target's final hidden state h[p] and the embedding of
the next token t[p+1] into a hidden state that predicts t[p+2]:

    g[p] = Block(eh_proj([enorm(embed(t[p+1])); hnorm(h[p])]))
    logits[p] = lm_head(final_norm(g[p]))

The embedding and lm_head are the target's. With k drafts and fewer layers, the last layer
runs again on its own output. Each layer owns a KV cache indexed by the target's block table.

Checkpoint layouts read here (names relative to the layer, after the prefix):
- Tandem head files: ``mtp.safetensors`` with ``layers.{i}.*`` plus ``mtp_config.json``;
- MiMo: ``model.mtp_layers.{i}.*`` (``token_layernorm``, ``hidden_layernorm``,
  ``input_proj``, ``final_layernorm``, and the block's usual names);
- DeepSeek-V3: ``model.layers.{num_hidden_layers + i}.*`` (``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, and the block's usual names).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tandem.layers.attention import AttentionBackend, AttentionMetadata
from tandem.models.llama import (
    DecoderLayer,
    RMSNorm,
    load_fused_weights,
    split_fused_weights,
)
from tandem.models.registry import ModelArchConfig

HEAD_WEIGHTS_FILE = "mtp.safetensors"
HEAD_CONFIG_FILE = "mtp_config.json"

# Per-layer names in each layout -> Tandem's names.
_MIMO_NAMES = {
    "token_layernorm": "enorm",
    "hidden_layernorm": "hnorm",
    "input_proj": "eh_proj",
    "final_layernorm": "final_norm",
}
_DEEPSEEK_NAMES = {"shared_head.norm": "final_norm"}


class MTPLayer(nn.Module):
    """One MTP module: two norms, a projection and one decoder block."""

    def __init__(self, arch: ModelArchConfig, rotary):
        super().__init__()
        self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
        self.block = DecoderLayer(arch, rotary)
        self.final_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the layer's hidden state g (pre final_norm) for each row."""
        fused = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
        return self.block(positions, fused, kv_cache, metadata, backend)


class MTPHead(nn.Module):
    """A stack of MTP layers sharing the target's embedding and lm_head."""

    def __init__(self, arch: ModelArchConfig, num_layers: int, rotary):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP head needs at least one layer, got {num_layers}")
        self.arch = arch
        self.layers = nn.ModuleList(MTPLayer(arch, rotary) for _ in range(num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_for_depth(self, depth: int) -> int:
        """Index of the layer that drafts at ``depth`` (0-based): the last one repeats."""
        return min(depth, self.num_layers - 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Tandem-named tensors (``layers.{i}.<name>``, q/k/v separate)."""
        load_fused_weights(self, self.arch, weights)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Tandem-named tensors, as ``load_weights`` reads them."""
        return split_fused_weights(self, self.arch)


def _block_name(rest: str) -> str:
    """A decoder-block weight name in HF form -> its name inside MTPLayer.block."""
    return "block." + rest


def rename_mimo(name: str) -> str | None:
    """``model.mtp_layers.{i}.X`` -> ``layers.{i}.Y``; None for other tensors."""
    match = re.fullmatch(r"model\.mtp_layers\.(\d+)\.(.+)", name)
    if match is None:
        return None
    index, rest = match.groups()
    for old, new in _MIMO_NAMES.items():
        if rest.startswith(old + "."):
            return f"layers.{index}.{new}{rest[len(old):]}"
    return f"layers.{index}.{_block_name(rest)}"


def rename_deepseek(name: str, num_hidden_layers: int) -> str | None:
    """``model.layers.{n + i}.X`` (the layers past the target's) -> ``layers.{i}.Y``."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None or int(match.group(1)) < num_hidden_layers:
        return None
    index, rest = int(match.group(1)) - num_hidden_layers, match.group(2)
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None  # shared with the target
    for old, new in {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                     **_DEEPSEEK_NAMES}.items():
        if rest.startswith(old + "."):
            return f"layers.{index}.{new}{rest[len(old):]}"
    return f"layers.{index}.{_block_name(rest)}"


def read_head_file(directory: str) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """A Tandem head directory: its layer count and its tensors."""
    from safetensors.torch import load_file

    config_path = os.path.join(directory, HEAD_CONFIG_FILE)
    weights_path = os.path.join(directory, HEAD_WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise ValueError(f"MTP head {directory!r} lacks {os.path.basename(path)}")
    with open(config_path) as f:
        config = json.load(f)
    try:
        tensors = load_file(weights_path)
    except Exception as e:
        raise ValueError(f"cannot read MTP weights {weights_path!r}: {e}") from e
    return int(config["num_layers"]), iter(tensors.items())


def save_head(head: MTPHead, directory: str, base_model: str, extra: dict | None = None) -> None:
    """Write a Tandem head directory (safetensors + a small JSON config)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(head.export_weights(), os.path.join(directory, HEAD_WEIGHTS_FILE))
    config = {"num_layers": head.num_layers, "base_model": base_model,
              "hidden_size": head.arch.hidden_size, **(extra or {})}
    with open(os.path.join(directory, HEAD_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
