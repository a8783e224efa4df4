"""The CUDA IPC KV connector: a process writes chosen blocks into another process's CUDA caches
on one GPU host; the blocks arrive exactly, nothing else changes, and nothing hangs."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue

import msgpack
import pytest
import torch

from tandem.disagg.cuda_ipc_connector import CudaIpcKVConnector, _HandleUnpickler
from tandem.disagg.kv_connector import (
    KVTransferError,
    cache_layout,
    check_compatible,
)
from tandem.disagg.setup import make_kv_connector

NUM_LAYERS = 3
NUM_BLOCKS = 16
SRC_BLOCKS = [3, 4, 5, 9]
DST_BLOCKS = [10, 11, 12, 2]
# Seconds to wait for the other process before failing instead of hanging.
CHILD_TIMEOUT_S = 60


def make_caches(seed: int, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    """Random per-layer caches shaped (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, 4, 2, 8)
    return [
        torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
        for _ in range(NUM_LAYERS)
    ]


def _receiver(dtype: torch.dtype, descriptors, results, done) -> None:
    """Register caches, publish the descriptor, wait for the write, report the outcome."""
    try:
        connector = CudaIpcKVConnector()
        caches = make_caches(1, dtype, "cuda")
        connector.register(caches)
        descriptors.put(msgpack.packb(connector.descriptor(), use_bin_type=True))
        if not done.wait(CHILD_TIMEOUT_S):
            results.put("receiver: the sender never finished")
            return
        expected = make_caches(1, dtype)
        for src_cache, dst_cache in zip(make_caches(0, dtype), expected, strict=True):
            dst_cache[:, DST_BLOCKS] = src_cache[:, SRC_BLOCKS]
        torch.cuda.synchronize()
        same = all(
            torch.equal(cache.cpu(), want) for cache, want in zip(caches, expected, strict=True)
        )
        results.put("ok" if same else "receiver: caches differ from the expected blocks")
        connector.close()
    except Exception as error:  # noqa: BLE001 (reported to the test, which fails)
        results.put(f"receiver: {error!r}")


def _sender(dtype: torch.dtype, descriptors, results, done) -> None:
    """Write SRC_BLOCKS of its caches into the receiver's DST_BLOCKS."""
    try:
        connector = CudaIpcKVConnector()
        connector.register(make_caches(0, dtype, "cuda"))
        torch.cuda.synchronize()  # write_blocks' precondition: the blocks' device work is done
        peer = msgpack.unpackb(descriptors.get(timeout=CHILD_TIMEOUT_S), raw=False)
        connector.write_blocks(peer, SRC_BLOCKS, DST_BLOCKS)
        connector.close()
        connector.close()
    except Exception as error:  # noqa: BLE001 (reported to the test, which fails)
        results.put(f"sender: {error!r}")
    finally:
        done.set()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_blocks_between_processes(dtype):
    context = multiprocessing.get_context("spawn")
    descriptors, results, done = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(target=target, args=(dtype, descriptors, results, done))
        for target in (_receiver, _sender)
    ]
    for process in processes:
        process.start()
    try:
        outcome = results.get(timeout=2 * CHILD_TIMEOUT_S)
    except queue.Empty:
        outcome = "no result from either process"
    finally:
        for process in processes:
            process.join(timeout=CHILD_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    assert outcome == "ok"
    assert [process.exitcode for process in processes] == [0, 0]


def test_register_rejects_cpu_tensors():
    connector = CudaIpcKVConnector()
    with pytest.raises(KVTransferError, match="CUDA tensors"):
        connector.register(make_caches(0, torch.float32))
    with pytest.raises(KVTransferError, match="register"):
        connector.descriptor()
    connector.close()
    connector.close()


def test_make_kv_connector_and_kind_check():
    connector = make_kv_connector("cuda_ipc")
    assert isinstance(connector, CudaIpcKVConnector)
    assert connector.kind == "cuda_ipc"
    layout = cache_layout(make_caches(0, torch.float32))
    check_compatible({"kind": "cuda_ipc", **layout}, {"kind": "cuda_ipc", **layout})
    with pytest.raises(KVTransferError, match="'kind'"):
        check_compatible({"kind": "cuda_ipc", **layout}, {"kind": "mooncake", **layout})


def test_handles_unpickle_only_torch_tensor_metadata():
    cache = make_caches(0, torch.bfloat16)[0]
    args = [
        (
            type(cache),
            cache.size(),
            cache.stride(),
            0,
            type(cache._typed_storage()),
            cache.dtype,
            0,
            b"handle",
            64,
            0,
            False,
            b"counter",
            0,
            b"event",
            True,
        )
    ]
    assert _HandleUnpickler(io.BytesIO(pickle.dumps(args))).load() == args
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _HandleUnpickler(io.BytesIO(pickle.dumps([os.system]))).load()
