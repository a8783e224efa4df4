"""The transport under the nccl KV connector: one pair's 2-rank process group, the TCPStore
clients and deadlines it runs on, and KV blocks moved over the group as messages of
consecutive layers (staging tensors ``(layers, 2, n, block_size, heads, head_dim)``),
``_WINDOW`` messages in flight. The protocol (who joins, requests, acknowledgements) is in
:mod:`tandem.disagg.nccl_connector`.

NCCL settings, read by ProcessGroupNCCL's constructor, so set only around ours:
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly: a failed op aborts the communicator and the
process lives; 1 TearDown and 3 SkipCleanUp, the default, end the process),
TORCH_NCCL_ENABLE_MONITORING=0 (no heartbeat monitor that kills it), TORCH_NCCL_DUMP_ON_TIMEOUT=0
and TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0 (no wait for a debug dump before the abort: it held a
timed-out receive over 30 s). NCCL_NVLS_ENABLE=0 where unset (point-to-point needs no multicast).
NCCL_SOCKET_IFNAME, where unset, names the interface of the configured host, for the whole
process (``pin_nccl_interface``): NCCL's bootstrap and proxy sockets listen there.

A gloo pair listens on the configured host too (its device is built for that address).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("tandem.disagg")

_WILDCARDS = ("", "0.0.0.0", "::")
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_WINDOW = 2  # messages in flight per transfer: gather/scatter overlap the wire
_NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
}


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables for the duration of the block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def socket_interface(host: str) -> str | None:
    """The name of the network interface that holds IPv4 address ``host`` (a name is
    resolved first); None if none does or it cannot be told (Linux only)."""
    try:
        address = socket.inet_aton(socket.gethostbyname(host))
        import fcntl  # POSIX only

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                with contextlib.suppress(OSError):  # an interface without an IPv4 address
                    if fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24] == address:
                        return name
    except (OSError, ImportError):
        return None
    return None


def pin_nccl_interface(host: str) -> None:
    """Make NCCL's own sockets (bootstrap, proxy) listen on the interface that holds
    ``host``: NCCL_SOCKET_IFNAME, set for the whole process (NCCL reads it once, at its first
    communicator), unless the user set it or ``host`` is a wildcard or on no interface."""
    if "NCCL_SOCKET_IFNAME" in os.environ or host in _WILDCARDS:
        return
    interface = socket_interface(host)
    if interface is None:
        logger.warning(
            "KV connector: no network interface holds %s; NCCL picks its own (set "
            "NCCL_SOCKET_IFNAME to choose)",
            host,
        )
        return
    os.environ["NCCL_SOCKET_IFNAME"] = f"={interface}"  # '=': this name exactly, no prefix
    logger.info("KV connector: NCCL_SOCKET_IFNAME==%s (the interface of %s)", interface, host)


def store_client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def seconds_left(deadline: float) -> timedelta:
    """The time until ``deadline`` (a ``time.monotonic()`` value); TimeoutError once past."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer deadline passed")
    return timedelta(seconds=left)


def _wait(work, deadline: float) -> None:
    if not work.wait(seconds_left(deadline)):
        raise TimeoutError("a send or receive did not complete in time")


def destroy_group(group) -> None:
    """Abort a pair's group (best effort: sockets close, NCCL communicators are aborted)."""
    with contextlib.suppress(Exception):
        if group is not None and hasattr(group, "abort"):
            group.abort()


class SenderPair:
    """The sender's side of one pair: its store client, index and process group."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.name = f"decode peer {host}:{port}"
        self.lock = threading.Lock()  # one transfer at a time per pair
        self.store = self.group = self.stream = None
        self.index = 0
        self.broken = False

    def close(self) -> None:
        """Tell the receiver's thread to stop (an empty request) and abort the group."""
        self.broken = True
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.queue_push(f"req{self.index}", b"")
        destroy_group(self.group)
        self.store = self.group = None


def pair_group(
    store,
    index: int,
    rank: int,
    timeout_s: float,
    cuda: bool,
    env_lock: threading.Lock,
    host: str = "",
):
    """The 2-rank group of pair ``index`` (gloo construction waits for the other rank); NCCL
    for ``cuda`` caches, built under ``env_lock`` (the NCCL environment is process-wide).
    A gloo pair listens on ``host`` (default, or a wildcard: the address of the machine's
    host name)."""
    prefixed = dist.PrefixStore(f"pair{index}/", store)
    timeout = timedelta(seconds=timeout_s)
    if not cuda:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        if host not in _WILDCARDS:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout  # the watchdog aborts an op this old (Work.wait may not)
    with env_lock, _environment(_NCCL_ENV):
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)


def _on_stream(stream) -> contextlib.AbstractContextManager:
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(stream.device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def layers_per_message(caches: list[torch.Tensor], num_blocks: int, message_bytes: int) -> int:
    """As many layers of ``num_blocks`` blocks as fit in ``message_bytes``, at least one."""
    first = caches[0]
    layer_bytes = 2 * num_blocks * first[0, 0].numel() * first.element_size()
    return max(1, message_bytes // layer_bytes)


def layer_runs(num_layers: int, per_message: int) -> list[range]:
    """The runs of consecutive layers sent as one message each."""
    return [
        range(start, min(start + per_message, num_layers))
        for start in range(0, num_layers, per_message)
    ]


def staging(caches: list[torch.Tensor], layers: range, num_blocks: int) -> torch.Tensor:
    """An empty message: ``(layers, 2, num_blocks, block_size, heads, head_dim)``."""
    first = caches[0]
    return torch.empty(
        (len(layers), 2, num_blocks, *first.shape[2:]), dtype=first.dtype, device=first.device
    )


def gather(caches: list[torch.Tensor], layers: range, index: torch.Tensor) -> torch.Tensor:
    """The blocks ``index`` of ``layers``, as one message."""
    message = staging(caches, layers, len(index))
    for row, layer in enumerate(layers):
        torch.index_select(caches[layer], 1, index, out=message[row])
    return message


def send_layers(
    group, stream, caches: list[torch.Tensor], src: list[int], per_message: int, deadline: float
) -> None:
    """Gather and send every layer's ``src`` blocks to rank 1, ``_WINDOW`` messages in flight."""
    in_flight: deque = deque()
    with _on_stream(stream):
        src_index = torch.tensor(src, device=caches[0].device)
        for layers in layer_runs(len(caches), per_message):
            message = gather(caches, layers, src_index)
            in_flight.append((group.send([message], 1, layers.start), message))
            if len(in_flight) > _WINDOW:
                _wait(in_flight.popleft()[0], deadline)
        while in_flight:
            _wait(in_flight.popleft()[0], deadline)


def receive_layers(
    group, stream, caches: list[torch.Tensor], dst: list[int], per_message: int, deadline: float
) -> None:
    """Receive every layer's blocks from rank 0, message by message, and scatter them into
    ``dst``."""
    in_flight: deque = deque()

    def scatter(layers: range, work, message: torch.Tensor) -> None:
        _wait(work, deadline)
        for row, layer in enumerate(layers):
            caches[layer].index_copy_(1, dst_index, message[row])

    with _on_stream(stream):
        dst_index = torch.tensor(dst, device=caches[0].device)
        for layers in layer_runs(len(caches), per_message):
            message = staging(caches, layers, len(dst))
            in_flight.append((layers, group.recv([message], 0, layers.start), message))
            if len(in_flight) > _WINDOW:
                scatter(*in_flight.popleft())
        while in_flight:
            scatter(*in_flight.popleft())
    if stream is not None:
        stream.synchronize()
