"""A KV connector over the Mooncake Transfer Engine (TCP, or RDMA where the hardware has it).

Each instance runs its own engine in P2P handshake mode: no metadata service, a peer is reached
at the session id ``host:rpc_port`` found in its descriptor. Mooncake ships as the optional
extra ``pd`` (``pip install 'tandem[pd]'``) and is imported only when a connector is built.

What bounds a blocking ``write_blocks`` (Mooncake has no per-call deadline):
- connecting to the peer's handshake port: Mooncake's MC_HANDSHAKE_CONNECT_TIMEOUT (5 s default);
  a refused connection (dead peer, wrong port) fails at once;
- a peer that accepts the handshake connection but never answers: Mooncake's fixed socket read
  timeout (60 s in 0.3.13);
- the transfer itself: ``timeout_s`` (Mooncake's MC_TRANSFER_TIMEOUT, at least 5 s) plus
  1 ns per byte written.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager

import torch

from tandem.disagg.kv_connector import KVConnector, KVTransferError, cache_layout

PROTOCOLS = ("tcp", "rdma")


@contextmanager
def _environment(name: str, value: str):
    """Set an environment variable for the duration of the block, then restore it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _import_mooncake_engine():
    try:
        import mooncake.engine
    except ImportError as error:
        raise ImportError(
            "the Mooncake KV connector needs the 'pd' extra: pip install 'tandem[pd]' "
            "(mooncake-transfer-engine-non-cuda, Linux x86_64) and the system libraries "
            f"libibverbs1 and libnuma1; importing it failed with: {error}"
        ) from error
    return mooncake.engine


class MooncakeKVConnector(KVConnector):
    """Writes KV blocks into a peer's registered caches with Mooncake batch writes.

    ``hostname`` is the address peers use to reach this instance, ``protocol`` is "tcp" or
    "rdma" (``device_name`` filters RDMA devices, e.g. "mlx5_0"; empty means all), and
    ``timeout_s`` bounds each transfer (Mooncake rounds it up to 5 s at least).
    """

    kind = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        timeout_s: float = 30.0,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {PROTOCOLS}, got {protocol!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        engine_module = _import_mooncake_engine()
        self.supports_cuda = bool(engine_module.SUPPORT_CUDA)
        self.hostname = hostname
        self.timeout_s = timeout_s
        # Mooncake reads its transfer deadline from the environment when an engine is built.
        with _environment("MC_TRANSFER_TIMEOUT", str(math.ceil(timeout_s))):
            self.engine = engine_module.TransferEngine()
        result = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if result != 0:
            raise KVTransferError(
                f"Mooncake TransferEngine.initialize({hostname!r}, "
                f"'P2PHANDSHAKE', {protocol!r}, {device_name!r}) failed "
                f"with {result}"
            )
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self.caches: list[torch.Tensor] = []
        self._registered: list[int] = []

    def register(self, caches: list[torch.Tensor]) -> None:
        """Register every cache tensor's memory with the engine (replacing earlier caches)."""
        cache_layout(caches)
        if caches[0].is_cuda and not self.supports_cuda:
            raise KVTransferError(
                "caches: CUDA tensors need a CUDA build of Mooncake; the "
                "installed mooncake-transfer-engine has no CUDA support"
            )
        self._unregister()
        addresses = [cache.data_ptr() for cache in caches]
        sizes = [cache.numel() * cache.element_size() for cache in caches]
        result = self.engine.batch_register_memory(addresses, sizes)
        if result != 0:
            raise KVTransferError(
                f"Mooncake batch_register_memory of {len(caches)} caches failed with {result}"
            )
        self.caches = list(caches)
        self._registered = addresses

    def descriptor(self) -> dict:
        """Session id, per-layer K and V base addresses and the layout of the caches."""
        if not self.caches:
            raise KVTransferError("register() the KV caches before descriptor()")
        return {
            "kind": self.kind,
            "session": self.session_id,
            "k_addrs": [cache[0].data_ptr() for cache in self.caches],
            "v_addrs": [cache[1].data_ptr() for cache in self.caches],
            **cache_layout(self.caches),
        }

    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        for field in ("k_addrs", "v_addrs"):
            if len(peer.get(field, ())) != len(self.caches):
                raise KVTransferError(
                    f"peer descriptor: {field!r} should hold {len(self.caches)} addresses"
                )
        if not isinstance(peer.get("session"), str):
            raise KVTransferError("peer descriptor lacks the field 'session'")
        block_bytes = peer["block_bytes"]
        sources, targets, lengths = [], [], []
        for layer, cache in enumerate(self.caches):
            halves = (
                (cache[0].data_ptr(), peer["k_addrs"][layer]),
                (cache[1].data_ptr(), peer["v_addrs"][layer]),
            )
            for local_base, peer_base in halves:
                for src, dst, length in runs:
                    sources.append(local_base + src * block_bytes)
                    targets.append(peer_base + dst * block_bytes)
                    lengths.append(length * block_bytes)
        if self.caches[0].is_cuda:
            # The blocks must hold what the model wrote, not what was queued.
            torch.cuda.synchronize(self.caches[0].device)
        start = time.monotonic()
        result = self.engine.batch_transfer_sync_write(peer["session"], sources, targets, lengths)
        if result != 0:
            raise KVTransferError(
                f"Mooncake write of {sum(lengths)} bytes in {len(lengths)} ranges to "
                f"{peer['session']} failed with {result} after {time.monotonic() - start:.1f} s "
                "(peer gone, unreachable or timed out; Mooncake's log says which)"
            )

    def _unregister(self) -> None:
        if self._registered:
            self.engine.batch_unregister_memory(self._registered)
        self._registered = []
        self.caches = []

    def close(self) -> None:
        """Unregister the caches and shut the engine down (its ports close)."""
        if self.engine is not None:
            self._unregister()
            self.engine = None
