"""KV connectors: write chosen KV blocks of this instance's cache into a peer instance's cache.

A KV cache is a list of per-layer tensors shaped ``(2, num_blocks, block_size, num_kv_heads,
head_dim)`` (keys at index 0, values at 1), contiguous, one dtype. Block ``b`` of a layer's keys
is the contiguous byte range ``caches[layer][0, b]``, so a run of consecutive block ids is one
contiguous range too: connectors move whole runs, never single blocks one by one.

The receiving side calls ``register`` and hands ``descriptor()`` (a msgpack-able dict) to the
sending side, which calls ``write_blocks(descriptor, src_blocks, dst_blocks)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

# Fields that must be equal on both sides for a block of one to be a block of the other.
LAYOUT_FIELDS = (
    "kind",
    "num_layers",
    "dtype",
    "block_size",
    "num_kv_heads",
    "head_dim",
    "block_bytes",
)


def gpu_id(device: torch.device | int) -> str:
    """The GPU's UUID, or its PCI address where torch does not expose the UUID."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    return (
        f"PCI-{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
        f"{getattr(props, 'pci_device_id', 0):02x}"
    )


class KVTransferError(RuntimeError):
    """A KV transfer failed, timed out, or the two sides' layouts do not match."""


def cache_layout(caches: list[torch.Tensor]) -> dict:
    """The layout fields of a KV cache (every layer must share one shape and dtype)."""
    if not caches:
        raise KVTransferError("caches: expected at least one layer, got none")
    first = caches[0]
    for layer, cache in enumerate(caches):
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise KVTransferError(
                f"caches[{layer}]: expected shape (2, num_blocks, block_size, "
                f"num_kv_heads, head_dim), got {tuple(cache.shape)}"
            )
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise KVTransferError(
                f"caches[{layer}]: shape {tuple(cache.shape)} {cache.dtype} "
                f"differs from layer 0's {tuple(first.shape)} {first.dtype}"
            )
        if not cache.is_contiguous():
            raise KVTransferError(f"caches[{layer}]: must be contiguous")
    _, num_blocks, block_size, num_kv_heads, head_dim = first.shape
    return {
        "num_layers": len(caches),
        "dtype": str(first.dtype).removeprefix("torch."),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_bytes": first[0, 0].numel() * first.element_size(),
    }


def cache_device(caches: list[torch.Tensor]) -> torch.device:
    """The one CPU or CUDA device every cache tensor lies on (KVTransferError otherwise)."""
    device = caches[0].device
    if device.type not in ("cpu", "cuda") or any(c.device != device for c in caches):
        raise KVTransferError(
            f"caches: expected one CPU or CUDA device, got "
            f"{sorted({str(cache.device) for cache in caches})}"
        )
    return device


def check_compatible(local: dict, peer: dict) -> None:
    """Raise KVTransferError naming the first layout field on which ``peer`` differs."""
    for field in LAYOUT_FIELDS:
        if field not in peer:
            raise KVTransferError(f"peer descriptor lacks the field {field!r}")
        if local.get(field) != peer[field]:
            raise KVTransferError(
                f"KV layout mismatch in {field!r}: local {local.get(field)!r}, peer {peer[field]!r}"
            )


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs: pairs consecutive on both sides are merged."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        if runs:
            src_start, dst_start, length = runs[-1]
            if src == src_start + length and dst == dst_start + length:
                runs[-1] = (src_start, dst_start, length + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _check_block_ids(name: str, blocks: list[int], num_blocks: int) -> None:
    for block in blocks:
        if not isinstance(block, int) or not 0 <= block < num_blocks:
            raise KVTransferError(f"{name}: block id {block!r} is outside [0, {num_blocks})")


class KVConnector(ABC):
    """Moves KV blocks from this instance's cache into a peer instance's cache.

    Subclasses implement ``register``, ``descriptor``, ``_write_runs`` and ``close``; the
    checks and the merging of block runs in ``write_blocks`` are shared.
    """

    @abstractmethod
    def register(self, caches: list[torch.Tensor]) -> None:
        """Remember (and register with the transfer library) the local KV cache tensors:
        target layers followed by MTP layers. Both sides must list layers in one order."""

    @abstractmethod
    def descriptor(self) -> dict:
        """A msgpack-able dict that a peer needs to write into this instance's caches: the
        connector kind, where to reach it, per-layer K and V base addresses and the layout
        fields (see ``LAYOUT_FIELDS``) that ``check_compatible`` compares."""

    def write_blocks(self, peer: dict, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy, for every layer, K and V of local block ``src_blocks[i]`` into the peer's block
        ``dst_blocks[i]``; blocking. The caller guarantees that the device work that wrote
        the source blocks is complete (the prefill role writes a request's blocks only after
        the host read its step's outputs): connectors do not wait on the model's stream, which
        under overlap already holds the next step. Raises KVTransferError on a layout
        mismatch, bad block ids, or any transfer failure or timeout."""
        local = self.descriptor()
        check_compatible(local, peer)
        if len(src_blocks) != len(dst_blocks):
            raise KVTransferError(
                f"src_blocks ({len(src_blocks)}) and dst_blocks "
                f"({len(dst_blocks)}) differ in length"
            )
        _check_block_ids("src_blocks", src_blocks, local["num_blocks"])
        if "num_blocks" not in peer:
            raise KVTransferError("peer descriptor lacks the field 'num_blocks'")
        _check_block_ids("dst_blocks", dst_blocks, peer["num_blocks"])
        if len(set(dst_blocks)) != len(dst_blocks):
            raise KVTransferError(f"dst_blocks: repeated block ids in {dst_blocks}")
        if src_blocks:
            self._write_runs(peer, block_runs(src_blocks, dst_blocks))

    @abstractmethod
    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        """Copy ``(src_start, dst_start, length)`` runs of blocks of every layer's K and V."""

    def close(self) -> None:
        """Release what ``register`` and the constructor acquired; safe to call twice."""
        return None  # nothing held by default


class LocalKVConnector(KVConnector):
    """Same-process copies with torch, for engine tests without a transfer library: connectors
    find each other by name in ``registry``, a dict that the test hands to all of them."""

    kind = "local"

    def __init__(self, registry: dict, name: str):
        self.registry = registry
        self.name = name
        self.caches: list[torch.Tensor] = []

    def register(self, caches: list[torch.Tensor]) -> None:
        """Publish ``caches`` in the registry under this connector's name."""
        cache_layout(caches)
        self.caches = list(caches)
        self.registry[self.name] = self.caches

    def descriptor(self) -> dict:
        """The layout and the registry name of this connector's caches."""
        if not self.caches:
            raise KVTransferError("register() the KV caches before descriptor()")
        return {"kind": self.kind, "name": self.name, **cache_layout(self.caches)}

    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        peer_caches = self.registry.get(peer.get("name"))
        if peer_caches is None:
            raise KVTransferError(f"no local KV connector named {peer.get('name')!r}")
        for src_cache, dst_cache in zip(self.caches, peer_caches, strict=True):
            for src, dst, length in runs:
                dst_cache[:, dst : dst + length].copy_(src_cache[:, src : src + length])

    def close(self) -> None:
        """Withdraw this connector's caches from the registry."""
        if self.registry.get(self.name) is self.caches:
            del self.registry[self.name]
        self.caches = []
