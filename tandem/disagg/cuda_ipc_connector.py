"""A KV connector between processes on one GPU host, over CUDA IPC.

The receiving side exports a CUDA IPC handle per layer cache (torch's ``reduce_tensor``); the
sending side opens them once per peer, which maps the peer's caches into its own address space,
and copies block runs with plain ``copy_`` on a stream of its own. A peer on another GPU of the
host works where the two GPUs have peer access, provided both processes number the GPUs alike
(same CUDA_VISIBLE_DEVICES): the handles name the peer's device by its index.

The handles travel pickled; the peer side unpickles them with an allowlist of the few torch
classes they hold, so a descriptor cannot make this process call arbitrary code.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.disagg.kv_connector import KVConnector, KVTransferError, cache_layout, gpu_id

# The globals that pickled rebuild_cuda_tensor arguments refer to (dtypes are checked apart).
_ALLOWED_GLOBALS = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        value = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _ALLOWED_GLOBALS or isinstance(value, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in CUDA IPC handles")


class CudaIpcKVConnector(KVConnector):
    """Writes KV blocks straight into the CUDA caches of another process on this host."""

    kind = "cuda_ipc"

    def __init__(self):
        self.caches: list[torch.Tensor] = []
        self._descriptor: dict | None = None
        self._stream: torch.cuda.Stream | None = None
        self._peers: dict[bytes, list[torch.Tensor]] = {}  # opened peer caches, by handles

    def register(self, caches: list[torch.Tensor]) -> None:
        """Export CUDA IPC handles of ``caches`` (CUDA tensors, all on one device)."""
        layout = cache_layout(caches)
        device = caches[0].device
        if device.type != "cuda" or any(cache.device != device for cache in caches):
            raise KVTransferError(
                f"caches: the cuda_ipc connector needs CUDA tensors on one "
                f"device, got {sorted({str(cache.device) for cache in caches})}"
            )
        handles = []
        for cache in caches:
            rebuild, args = reduce_tensor(cache)
            if rebuild is not rebuild_cuda_tensor:
                raise KVTransferError(
                    f"caches: torch cannot share {rebuild.__name__} tensors over CUDA IPC"
                )
            handles.append(args)
        self.caches = list(caches)
        self._stream = torch.cuda.Stream(device)
        self._descriptor = {
            "kind": self.kind,
            "pid": os.getpid(),
            "device_index": device.index,
            "device_id": gpu_id(device),
            "handles": pickle.dumps(handles),
            **layout,
        }

    def descriptor(self) -> dict:
        """Layout, process id, GPU (index and UUID) and the pickled IPC handles of the caches."""
        if self._descriptor is None:
            raise KVTransferError("register() the KV caches before descriptor()")
        return self._descriptor

    def _open(self, peer: dict) -> list[torch.Tensor]:
        """The peer's caches mapped into this process (opened once per peer)."""
        handles = peer.get("handles")
        if not isinstance(handles, bytes):
            raise KVTransferError("peer descriptor lacks the field 'handles'")
        if handles in self._peers:
            return self._peers[handles]
        name = f"pid {peer.get('pid')} on {peer.get('device_id')}"
        if peer.get("pid") == os.getpid():
            raise KVTransferError(
                f"peer {name} is this process: CUDA IPC cannot open its own "
                "handles (use the local connector)"
            )
        index = peer.get("device_index")
        if (
            not isinstance(index, int)
            or not 0 <= index < torch.cuda.device_count()
            or gpu_id(index) != peer.get("device_id")
        ):
            raise KVTransferError(
                f"peer {name}: its GPU is not cuda:{index} in this process "
                "(another host, or a different CUDA_VISIBLE_DEVICES)"
            )
        try:
            caches = [
                rebuild_cuda_tensor(*args) for args in _HandleUnpickler(io.BytesIO(handles)).load()
            ]
        except (RuntimeError, pickle.UnpicklingError, TypeError, ValueError) as error:
            raise KVTransferError(
                f"cannot open the KV caches of peer {name} over CUDA IPC "
                f"(no peer access between the GPUs, or the peer is gone): "
                f"{error}"
            ) from error
        if len(caches) != len(self.caches):
            raise KVTransferError(
                f"peer {name} shares {len(caches)} caches, expected {len(self.caches)}"
            )
        self._peers[handles] = caches
        return caches

    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        peer_caches = self._open(peer)
        try:
            # No wait on the model's stream: write_blocks' caller guarantees the blocks are
            # complete, and a wait would also take the step queued behind (overlap).
            with torch.cuda.stream(self._stream):
                for src_cache, dst_cache in zip(self.caches, peer_caches, strict=True):
                    for src, dst, length in runs:
                        dst_cache[:, dst : dst + length].copy_(
                            src_cache[:, src : src + length], non_blocking=True
                        )
            self._stream.synchronize()
        except RuntimeError as error:
            raise KVTransferError(
                f"CUDA IPC write to peer pid {peer.get('pid')} on "
                f"{peer.get('device_id')} failed: {error}"
            ) from error

    def close(self) -> None:
        """Unmap the peers' caches and forget the local ones; safe to call twice."""
        self._peers.clear()
        self.caches = []
        self._descriptor = None
        self._stream = None
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
