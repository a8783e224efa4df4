"""An MTP head's directory: ``mtp.safetensors`` (Tandem-named tensors, ``layers.{i}.*``)
and ``mtp_config.json`` (its layer count, fused feature layers and training record)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

HEAD_WEIGHTS_FILE = "mtp.safetensors"
HEAD_CONFIG_FILE = "mtp_config.json"


def read_head_file(directory: str) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """A Tandem head directory: its layer count and its tensors (``head_feature_layers``
    reads its feature layers)."""
    from safetensors.torch import load_file

    config = _read_head_config(directory)
    weights_path = os.path.join(directory, HEAD_WEIGHTS_FILE)
    if not os.path.exists(weights_path):
        raise ValueError(f"MTP head {directory!r} lacks {HEAD_WEIGHTS_FILE}")
    try:
        tensors = load_file(weights_path)
    except Exception as e:
        raise ValueError(f"cannot read MTP weights {weights_path!r}: {e}") from e
    return int(config["num_layers"]), iter(tensors.items())


def head_feature_layers(directory: str) -> tuple[int, ...]:
    """The target layers a head directory's first draft takes fused features of (none for
    heads that take the final hidden state)."""
    layers = _read_head_config(directory).get("feature_layers", [])
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"MTP head {directory!r}: feature_layers must be a list of integers")
    return tuple(layers)


def _read_head_config(directory: str) -> dict:
    """A head directory's mtp_config.json; ValueError naming what is missing or broken."""
    path = os.path.join(directory, HEAD_CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"MTP head {directory!r} lacks {HEAD_CONFIG_FILE}")
    try:
        with open(path) as f:
            config = json.load(f)
        config["num_layers"] = int(config["num_layers"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"MTP head config {path!r} is invalid: {e}") from e
    return config


def save_head(
    head: torch.nn.Module,
    directory: str,
    base_model: str,
    extra: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write an ``MTPHead``'s directory (safetensors in ``dtype`` + a small JSON config)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    weights = {name: t.to(dtype).contiguous() for name, t in head.export_weights().items()}
    save_file(weights, os.path.join(directory, HEAD_WEIGHTS_FILE))
    config = {
        "num_layers": head.num_layers,
        "base_model": base_model,
        "hidden_size": head.arch.hidden_size,
        **({"feature_layers": list(head.feature_layers)} if head.feature_layers else {}),
        **(extra or {}),
    }
    with open(os.path.join(directory, HEAD_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)


def head_training_tokens(head_dir: str | None) -> tuple[int | None, bool]:
    """The tokens a head was trained on, from its config's ``training`` record
    (``total_tokens``, else its last run's steps x batch x length), and whether the count is
    complete (False when that run continued another head whose count it lacks)."""
    if head_dir is None:
        return None, False
    try:
        with open(os.path.join(head_dir, HEAD_CONFIG_FILE)) as f:
            training = json.load(f).get("training")
    except (OSError, ValueError):
        return None, False
    if not isinstance(training, dict):
        return None, False
    if isinstance(training.get("total_tokens"), int):
        return training["total_tokens"], True
    config = training.get("config") or {}
    try:
        tokens = int(training["steps_run"]) * int(config["batch_size"]) * int(config["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None, False
    return tokens, config.get("init_head") is None
