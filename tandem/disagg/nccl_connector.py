"""A KV connector over torch.distributed point-to-point: NCCL between GPUs of one host or
several (never two ranks on one GPU), gloo between CPU processes.

The receiving (decode) side runs a TCPStore server; its descriptor names it. A sender joins on
its first write: it takes a pair index ``k`` (``add``), pushes it on the ``joins`` queue, and
both build a 2-rank group on ``PrefixStore(f"pair{k}/", store)`` (sender rank 0; no global
process group); a thread serves each pair. A transfer: the sender pushes the destination runs
and the layers per message on ``req{k}``, the receiver answers ``ready{k}`` and posts a
receive per message, the sender gathers runs of consecutive layers' blocks into staging
tensors ``(layers, 2, n, block_size, heads, head_dim)`` and sends them, the receiver scatters
them into its cache and pushes ``ok`` (or why not) on ``ack{k}``; ``write_blocks`` returns
after that. Pops remove what they read.

Bounds. A write runs in a daemon worker and ends within ``timeout_s``: a TCPStore client waits
forever on a stalled server, so such a worker is abandoned. Any failure drops the pair on both
sides. A sender that dies mid-transfer costs only its pair: over gloo at once; over NCCL when
the group's watchdog aborts the receive, ``timeout_s`` after it was posted plus seconds of
reporting (torch 2.11: ``Work.wait(timeout)`` did not end it sooner), and until then a
device-wide synchronize in the receiving process waits too. A sender that dies idle leaves one
blocked thread until ``close()``.

The pair's group, the NCCL settings it is built with, and the staging, gather, send and
scatter of the messages are in :mod:`tandem.disagg.nccl_transport`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from tandem.disagg.kv_connector import (
    KVConnector,
    KVTransferError,
    cache_device,
    cache_layout,
    gpu_id,
)
from tandem.disagg.nccl_transport import (
    SenderPair,
    destroy_group,
    first_line,
    layers_per_message,
    pair_group,
    pin_nccl_interface,
    receive_layers,
    seconds_left,
    send_layers,
    store_client,
)
from tandem.models.tensor_parallel import keep_nvlink_multicast_off

logger = logging.getLogger("tandem.disagg")

_GRACE_S = 0.25  # for the worker to report its own (more precise) error at the deadline
_CLOSE_S = 2.0  # close() waits this long at most for the threads
_IDLE = timedelta(hours=12)  # a blocking pop on our own store: loops on timeout


def _bound_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server listening only on ``host`` (a free port). TCPStore binds every
    interface when it opens its own socket: it is handed one bound here instead, and owns
    (and closes) its descriptor from then on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    try:
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes it: closing it here too could close a reused number
    return store


class NcclKVConnector(KVConnector):
    """Sends KV blocks to a peer's caches with point-to-point ops of a 2-rank process group.

    ``host`` is where peers reach this instance's TCPStore and the only address its store and
    gloo pairs listen on (NCCL: see ``pin_nccl_interface``), ``timeout_s`` bounds every write
    (and every receive), ``serve`` starts the store and accepts writes (the decode side; a
    prefill instance passes False). CPU caches use gloo, CUDA caches NCCL.
    """

    kind = "nccl"

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        serve: bool = True,
        message_bytes: int = 64 << 20,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        if message_bytes <= 0:
            raise ValueError(f"message_bytes: expected a positive number, got {message_bytes!r}")
        # A write sends runs of consecutive layers, one message of at most message_bytes per
        # run (at least one layer): each wait for a message polls, so few messages mean few
        # round trips; staging stays under (_WINDOW + 1) * message_bytes per side (the
        # window of nccl_transport). The sender picks the run length and announces it with
        # the request.
        self.message_bytes = message_bytes
        if not dist.is_available():
            raise ImportError("the nccl KV connector needs a torch build with torch.distributed")
        self.host, self.timeout_s, self.serve = host, timeout_s, serve
        self.caches: list[torch.Tensor] = []
        self._descriptor: dict | None = None
        self._server: dist.TCPStore | None = None
        self._lock = threading.Lock()  # guards _pairs and _receivers
        self._env_lock = threading.Lock()  # the NCCL environment is process-wide
        self._pairs: dict[tuple[str, int], SenderPair] = {}
        self._receivers: dict[int, threading.Thread] = {}
        self._threads: list[threading.Thread] = []  # the watcher, send workers
        self._closed = threading.Event()

    def register(self, caches: list[torch.Tensor]) -> None:
        """Remember ``caches`` (all on one device); with ``serve``, start the store and watcher."""
        if self.caches:
            raise KVTransferError("register(): the caches are registered already")
        layout = cache_layout(caches)
        device = cache_device(caches)
        self.caches = list(caches)
        self._descriptor = {
            "kind": self.kind,
            "device": device.type,
            "pid": os.getpid(),
            "node": socket.gethostname(),
            **layout,
        }
        if device.type == "cuda":
            keep_nvlink_multicast_off()
            pin_nccl_interface(self.host)
            self._descriptor["gpu"] = gpu_id(device)
        if self.serve:
            self._server = _bound_store(self.host, self.timeout_s)
            self._descriptor.update(host=self.host, port=self._server.port)
            self._threads.append(
                threading.Thread(target=self._watch, daemon=True, name="tandem-kv-watch")
            )
            self._threads[-1].start()

    def descriptor(self) -> dict:
        """Kind, device type and GPU, process, the store's host and port (if serving), layout."""
        if self._descriptor is None:
            raise KVTransferError("register() the KV caches before descriptor()")
        return self._descriptor

    # ---- both sides ----------------------------------------------------------------------

    def _group(self, store, index: int, rank: int):
        """The 2-rank group of pair ``index`` (gloo construction waits for the other rank)."""
        cuda = self.caches[0].is_cuda
        return pair_group(store, index, rank, self.timeout_s, cuda, self._env_lock, self.host)

    def _new_stream(self):
        return torch.cuda.Stream(self.caches[0].device) if self.caches[0].is_cuda else None

    # ---- sending side --------------------------------------------------------------------

    def _write_runs(self, peer: dict, runs: list[tuple[int, int, int]]) -> None:
        host, port = peer.get("host"), peer.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise KVTransferError(
                "peer descriptor lacks 'host' and 'port' (a connector built "
                "with serve=False receives nothing)"
            )
        if peer.get("device") != self._descriptor["device"]:
            raise KVTransferError(
                f"peer caches are on {peer.get('device')!r}, local ones on "
                f"{self._descriptor['device']!r}"
            )
        if "gpu" in peer and peer["gpu"] == self._descriptor.get("gpu"):
            raise KVTransferError(
                f"peer {host}:{port} uses this GPU ({peer['gpu']}): NCCL cannot "
                "join two ranks on one GPU (use the cuda_ipc connector)"
            )
        if peer.get("pid") == os.getpid() and peer.get("node") == socket.gethostname():
            raise KVTransferError(
                f"peer {host}:{port} is this process: sender and receiver "
                "must be different processes"
            )
        deadline = time.monotonic() + self.timeout_s
        outcome: dict = {}
        done = threading.Event()
        with self._lock:
            pair = self._pairs.setdefault((host, port), SenderPair(host, port))

        def work() -> None:
            try:
                self._transfer(pair, runs, deadline)
            except Exception as error:  # noqa: BLE001 (reported to the caller)
                outcome["error"] = KVTransferError(
                    f"KV write to {pair.name} failed: {first_line(error)}"
                )
                done.set()  # the caller hears of it before the pair's (slower) cleanup
                self._forget(pair)
                pair.close()
            else:
                done.set()

        worker = threading.Thread(target=work, daemon=True, name="tandem-kv-send")
        with self._lock:
            self._threads = [thread for thread in self._threads if thread.is_alive()] + [worker]
        worker.start()
        if not done.wait(self.timeout_s + _GRACE_S):
            self._forget(pair)
            raise KVTransferError(
                f"KV write to {pair.name}: no answer within {self.timeout_s} s "
                "(the receiver is stalled or unreachable)"
            )
        if "error" in outcome:
            raise outcome["error"]

    def _forget(self, pair: SenderPair) -> None:
        pair.broken = True
        with self._lock:
            if self._pairs.get((pair.host, pair.port)) is pair:
                del self._pairs[(pair.host, pair.port)]

    def _transfer(self, pair: SenderPair, runs, deadline: float) -> None:
        if not pair.lock.acquire(timeout=seconds_left(deadline).total_seconds()):
            raise TimeoutError("an earlier write to this peer did not end")
        try:
            if pair.broken:
                raise KVTransferError("the pair broke during an earlier write")
            if pair.group is None:  # join: take a pair index, announce it, build the group
                # A dead receiver refuses at once; TCPStore would retry past the deadline.
                socket.create_connection(
                    (pair.host, pair.port), seconds_left(deadline).total_seconds()
                ).close()
                pair.store = store_client(pair.host, pair.port, seconds_left(deadline))
                pair.index = pair.store.add("pairs", 1)
                pair.store.queue_push("joins", str(pair.index))
                pair.group = self._group(pair.store, pair.index, rank=0)
                pair.stream = self._new_stream()
            store, index = pair.store, pair.index
            num_blocks = sum(n for _, _, n in runs)
            per_message = layers_per_message(self.caches, num_blocks, self.message_bytes)
            store.queue_push(
                f"req{index}",
                msgpack.packb(
                    {"runs": [[dst, n] for _, dst, n in runs], "layers_per_message": per_message}
                ),
            )
            store.set_timeout(seconds_left(deadline))
            ready = store.queue_pop(f"ready{index}")
            if ready != b"ok":
                raise KVTransferError(f"the receiver refused the transfer: {ready.decode()}")
            self._send_layers(
                pair,
                [b for start, _, n in runs for b in range(start, start + n)],
                per_message,
                deadline,
            )
            store.set_timeout(seconds_left(deadline))
            ack = store.queue_pop(f"ack{index}")
            if ack != b"ok":
                raise KVTransferError(f"the receiver failed: {ack.decode()}")
        finally:
            pair.lock.release()

    def _send_layers(
        self, pair: SenderPair, src: list[int], per_message: int, deadline: float
    ) -> None:
        """Gather and send every layer's ``src`` blocks, a window of messages in flight."""
        send_layers(pair.group, pair.stream, self.caches, src, per_message, deadline)

    # ---- receiving side ------------------------------------------------------------------

    def _pop(self, store, key: str) -> bytes | None:
        """The next value of queue ``key`` on our own store; None once closing."""
        while not self._closed.is_set():
            try:
                return store.queue_pop(key)
            except dist.DistStoreError:  # idle past _IDLE: wait again
                continue
        return None

    def _watch(self) -> None:
        """Start a receiving thread for every pair that joins."""
        try:
            store = store_client(self.host, self._server.port, _IDLE)
            while (joined := self._pop(store, "joins")) and not self._closed.is_set():
                index = int(joined)
                thread = threading.Thread(
                    target=self._receive, args=(index,), daemon=True, name=f"tandem-kv-recv{index}"
                )
                with self._lock:
                    self._receivers[index] = thread
                thread.start()
        except Exception as error:  # noqa: BLE001 (the store went away: closing)
            if not self._closed.is_set():
                logger.error("KV connector: the pair watcher stopped: %s", first_line(error))

    def _receive(self, index: int) -> None:
        """Serve the transfers of pair ``index`` until its sender leaves, fails or we close."""
        group = None
        try:
            port = self._server.port
            control = store_client(self.host, port, _IDLE)
            group = self._group(
                store_client(self.host, port, timedelta(seconds=self.timeout_s)), index, rank=1
            )
            stream = self._new_stream()
            while (request := self._pop(control, f"req{index}")) and not self._closed.is_set():
                deadline = time.monotonic() + self.timeout_s
                request = msgpack.unpackb(request)
                dst = [b for start, n in request["runs"] for b in range(start, start + n)]
                per_message = request["layers_per_message"]
                num_blocks = self._descriptor["num_blocks"]
                if any(not 0 <= block < num_blocks for block in dst):
                    control.queue_push(f"ready{index}", f"ids outside [0, {num_blocks})".encode())
                    continue
                if not isinstance(per_message, int) or per_message < 1:
                    control.queue_push(f"ready{index}", b"layers_per_message must be >= 1")
                    continue
                control.queue_push(f"ready{index}", b"ok")
                try:
                    receive_layers(group, stream, self.caches, dst, per_message, deadline)
                except Exception as error:  # reported to the sender, then the pair is dropped
                    control.queue_push(f"ack{index}", first_line(error).encode())
                    raise
                control.queue_push(f"ack{index}", b"ok")
        except Exception as error:  # noqa: BLE001 (a dead or failed sender ends only its pair)
            if not self._closed.is_set():
                logger.warning("KV connector: dropped pair %d: %s", index, first_line(error))
        finally:
            destroy_group(group)
            with self._lock:
                self._receivers.pop(index, None)

    def close(self) -> None:
        """Stop the threads, abort the pairs' groups and close the store; safe to call twice.
        Waits at most ``_CLOSE_S`` for the threads (one mid-transfer ends within timeout_s)."""
        self._closed.set()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            threads, self._threads = self._threads, []
            receivers, self._receivers = dict(self._receivers), {}
        for pair in pairs:  # in threads: a stalled peer's store must not hold close() up
            threads.append(threading.Thread(target=pair.close, daemon=True))
            threads[-1].start()
        if self._server is not None:
            with contextlib.suppress(Exception):  # empty values stop the watcher and receivers
                for key in ["joins", *(f"req{index}" for index in receivers)]:
                    self._server.queue_push(key, b"")
        end = time.monotonic() + _CLOSE_S
        for thread in [*threads, *receivers.values()]:
            thread.join(timeout=max(end - time.monotonic(), 0.0))
        self._server = None
        self.caches = []
        self._descriptor = None
