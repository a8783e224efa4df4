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

import dataclasses
import os
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tandem.layers.attention import AttentionBackend, AttentionMetadata
from tandem.layers.skinny_linear import two_norm_linear
from tandem.models.llama import (
    DecoderLayer,
    RMSNorm,
    load_fused_weights,
    split_fused_weights,
)
from tandem.models.mtp_files import HEAD_CONFIG_FILE, head_feature_layers, read_head_file
from tandem.models.registry import ModelArchConfig

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
        """Returns the layer's hidden state g (pre final_norm) for each row. ``hidden`` wider
        than the model is the target's output with the head's fused base features after its
        final hidden state (``MTPHead.feature_layers``): the features are what it drafts from."""
        out, residual = self._block_outputs(
            positions, token_embeds, hidden, kv_cache, metadata, backend
        )
        return out + residual

    def forward_normed(
        self, positions, token_embeds, hidden, kv_cache, metadata, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, ``final_norm(g)``) with the block's residual add inside the norm's kernel."""
        out, residual = self._block_outputs(
            positions, token_embeds, hidden, kv_cache, metadata, backend
        )
        normed, summed = self.final_norm(out, residual=residual)
        return summed, normed

    def _block_outputs(self, positions, token_embeds, hidden, kv_cache, metadata, backend):
        size = self.hnorm.weight.shape[0]
        if hidden.shape[-1] != size:
            hidden = hidden[..., -size:]
        # At a few rows on the GPU both norms run inside the projection's kernel.
        fused = two_norm_linear(
            token_embeds,
            hidden,
            self.enorm.weight,
            self.hnorm.weight,
            self.enorm.eps,
            self.eh_proj.weight,
        )
        return self.block(positions, fused, kv_cache, metadata, backend)


class MTPHead(nn.Module):
    """A stack of MTP layers sharing the target's embedding and lm_head. With
    ``feature_layers`` (indices of the target's decoder layers), its first draft starts from
    ``feature_proj`` of the residual stream after those layers (EAGLE-3's low, middle and
    high features) in place of the target's final hidden state."""

    def __init__(
        self, arch: ModelArchConfig, num_layers: int, rotary, feature_layers: tuple[int, ...] = ()
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP head needs at least one layer, got {num_layers}")
        self.arch = arch
        self.layers = nn.ModuleList(MTPLayer(arch, rotary) for _ in range(num_layers))
        self.feature_layers = tuple(feature_layers)
        if feature_layers != tuple(sorted(set(feature_layers))):
            raise ValueError(f"feature layers must be increasing, got {list(feature_layers)}")
        self.feature_proj = (
            nn.Linear(len(feature_layers) * arch.hidden_size, arch.hidden_size, bias=False)
            if feature_layers
            else None
        )

    def fuse_features(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The first draft's input from the residual stream after ``feature_layers``."""
        return self.feature_proj(torch.cat(states, dim=-1))

    def add_feature_projection(self, layers: tuple[int, ...], final_norm_weight) -> None:
        """Give a head without features a projection of ``layers`` that starts as the head it
        was: the last layer's block the target's final norm weight (the layer's own hnorm
        makes the scale moot), the others zero. ``layers`` must end with the target's last
        layer (the state the head took until now)."""
        if self.feature_proj is not None:
            raise ValueError("the head already takes fused features")
        last = self.arch.num_layers - 1
        if not layers or layers[-1] != last:
            raise ValueError(f"feature layers must end with the base's last layer, {last}")
        size = self.arch.hidden_size
        projection = nn.Linear(len(layers) * size, size, bias=False)
        with torch.no_grad():
            projection.weight.zero_()
            projection.weight[:, -size:].copy_(torch.diag(final_norm_weight.float()))
        self.feature_layers = tuple(layers)
        self.feature_proj = projection.to(next(self.parameters()).device)

    def grow(self, num_layers: int) -> None:
        """Add copies of the last layer up to ``num_layers``: each new layer starts as the
        layer that drafted its depths until now, with KV of its own at every position."""
        if num_layers < self.num_layers:
            raise ValueError(f"a head of {self.num_layers} layers cannot grow to {num_layers}")
        last = self.layers[-1]
        while self.num_layers < num_layers:
            layer = MTPLayer(self.arch, last.block.self_attn.rotary)
            layer.load_state_dict(last.state_dict())
            self.layers.append(layer.to(last.eh_proj.weight.device, last.eh_proj.weight.dtype))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_for_depth(self, depth: int) -> int:
        """Index of the layer that drafts at ``depth`` (0-based): the last one repeats."""
        return min(depth, self.num_layers - 1)

    def fuse_gate_up(self) -> None:
        """Every layer's MLP with one gate-up matrix, as the target's on the GPU
        (``MLP.fuse_gate_up``); ``export_weights`` splits them again."""
        for layer in self.layers:
            layer.block.mlp.fuse_gate_up()

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
            return f"layers.{index}.{new}{rest[len(old) :]}"
    return f"layers.{index}.{_block_name(rest)}"


def rename_deepseek(name: str, num_hidden_layers: int) -> str | None:
    """``model.layers.{n + i}.X`` (the layers past the target's) -> ``layers.{i}.Y``."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None or int(match.group(1)) < num_hidden_layers:
        return None
    index, rest = int(match.group(1)) - num_hidden_layers, match.group(2)
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None  # shared with the target
    for old, new in {
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        **_DEEPSEEK_NAMES,
    }.items():
        if rest.startswith(old + "."):
            return f"layers.{index}.{new}{rest[len(old) :]}"
    return f"layers.{index}.{_block_name(rest)}"


DUMMY_HEAD = "dummy"


def _checkpoint_layout(files) -> tuple[str, int] | None:
    """("mimo" | "deepseek", number of MTP layers) if the target checkpoint carries them."""
    if files.is_dummy or not os.path.isdir(files.path):
        return None
    from safetensors import safe_open

    mimo, deepseek = set(), set()
    num_hidden = files.arch.num_layers
    for file in sorted(f for f in os.listdir(files.path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(files.path, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if (m := re.match(r"model\.mtp_layers\.(\d+)\.", name)) is not None:
                    mimo.add(int(m.group(1)))
                elif (m := re.match(r"model\.layers\.(\d+)\.", name)) and (
                    int(m.group(1)) >= num_hidden
                ):
                    deepseek.add(int(m.group(1)))
    if mimo:
        return "mimo", len(mimo)
    if deepseek:
        return "deepseek", len(deepseek)
    return None


def _shipped_head(files) -> str:
    """The head that ships with Tandem for this model, or a ValueError saying what to do."""
    from tandem.models.loader import DEFAULT_MODEL_FILE

    heads = os.path.join(os.path.dirname(os.path.dirname(__file__)), "heads")
    if os.path.basename(files.path) == DEFAULT_MODEL_FILE:
        path = os.path.join(heads, "smollm2-135m-instruct")
        if os.path.exists(os.path.join(path, HEAD_CONFIG_FILE)):
            return path
    raise ValueError(
        f"model {files.path!r} has no MTP layers and no shipped head: pass "
        "speculative_model=PATH (a head from `tandem train-mtp`) or 'dummy' (random weights)"
    )


def has_mtp_head(files, source: str | None = None) -> bool:
    """Whether ``load_mtp_head(source, files, ...)`` finds a head: a named one always, else
    the checkpoint's own MTP layers or the head shipped for the default model."""
    if source is not None or _checkpoint_layout(files) is not None:
        return True
    try:
        _shipped_head(files)
    except ValueError:
        return False
    return True


def resolve_auto_speculation(config, files):
    """``config`` with speculative method "auto" made concrete: MTP on CUDA when the model
    has a head (``has_mtp_head``), else none. On the CPU MTP stays off by default: with no
    CUDA graphs the host pays for every draft depth's launches and MTP is slower there."""
    spec = config.speculative
    if spec.method != "auto":
        return config
    on = config.device.startswith("cuda") and has_mtp_head(files, spec.model)
    method, tokens = ("mtp", spec.num_speculative_tokens) if on else (None, 0)
    return dataclasses.replace(
        config,
        speculative=dataclasses.replace(
            spec,
            method=method,
            num_speculative_tokens=tokens,
            draft_schedule=spec.draft_schedule if on else (),
        ),
    )


def random_head(arch: ModelArchConfig, num_layers: int, rotary, seed: int = 0) -> MTPHead:
    """A head of ``num_layers`` random layers (norms at one), the same for the same seed."""
    head = MTPHead(arch, num_layers, rotary)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape).uniform_(-0.05, 0.05, generator=generator))
    return head


def load_mtp_head(source: str | None, files, rotary, seed: int = 0) -> MTPHead:
    """The MTP head for ``files``'s model: ``source`` is a Tandem head directory, 'dummy'
    (random weights, for tests and benchmarks), or None (the checkpoint's own MTP layers,
    else the head shipped for the default model)."""
    arch = files.arch
    if source == DUMMY_HEAD:
        return random_head(arch, 1, rotary, seed)
    if source is None:
        layout = _checkpoint_layout(files)
        if layout is not None:
            kind, num_layers = layout
            head = MTPHead(arch, num_layers, rotary)
            head.load_weights(_renamed_checkpoint(files, kind))
            return head
        source = _shipped_head(files)
    num_layers, tensors = read_head_file(source)
    head = MTPHead(arch, num_layers, rotary, head_feature_layers(source))
    if any(not 0 <= index < arch.num_layers for index in head.feature_layers):
        raise ValueError(
            f"MTP head {source!r}: feature layers {list(head.feature_layers)} outside the "
            f"target's 0..{arch.num_layers - 1}"
        )
    head.load_weights(tensors)
    return head


def _renamed_checkpoint(files, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(f for f in os.listdir(files.path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(files.path, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if kind == "mimo":
                    new = rename_mimo(name)
                else:
                    new = rename_deepseek(name, files.arch.num_layers)
                if new is None:
                    continue
                tensor = f.get_tensor(name)
                if kind == "mimo" and new.endswith("eh_proj.weight"):
                    # MiMo's input_proj takes [hidden; embedding]; eh_proj takes the reverse.
                    half = files.arch.hidden_size
                    tensor = torch.cat([tensor[:, half:], tensor[:, :half]], dim=1)
                yield new, tensor
