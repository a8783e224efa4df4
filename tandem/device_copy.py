"""Host <-> device copies that never stall the host behind the device's queue.

A plain ``torch.tensor(values, device="cuda")`` waits for every kernel queued before it;
the engine's step loop must not. Host-to-device copies go through pinned memory without
blocking; device-to-host reads are gathered into one :class:`DeviceReader` wait per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


def _host_tensor(values, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host tensor of ``dtype`` holding ``values``: a list (or any sequence) is written
    into a new tensor, pinned at once when ``pinned``; a numpy array is shared and a host
    tensor taken as is, both converted to ``dtype`` and, when ``pinned``, copied into pinned
    memory."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
    else:
        return torch.tensor(values, dtype=dtype, pin_memory=pinned)
    return host.pin_memory() if pinned else host


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A device tensor of host ``values`` (a list, a numpy array or a host tensor), copied
    without a wait."""
    device = torch.device(device)
    if device.type != "cuda":
        return _host_tensor(values, dtype, pinned=False)
    return _host_tensor(values, dtype, pinned=True).to(device, non_blocking=True)


@dataclass
class PendingRead:
    """Device results whose copies to the host are queued, and the event after them."""

    tensors: list[torch.Tensor]  # pinned host tensors on CUDA (filled once event is done)
    event: torch.cuda.Event | None = None
    begun: torch.cuda.Event | None = None  # where the step's device work began (timing on)


class DeviceReader:
    """The one place where the host waits for the device. ``start`` queues a step's result
    copies right behind the step (pinned host buffers, non-blocking) and records an event;
    ``read`` waits for that event only, so the steps queued after it keep the device busy
    while the host reads. ``num_waits`` counts the waits (tests check one per step);
    ``wait_seconds`` sums the time spent in them (the host idle, the device the bottleneck).
    With ``time_steps`` set on CUDA, ``device_seconds`` sums each read step's device time:
    from the event ``begin`` recorded as its launch began to the event after its copies
    (kernels plus any gap in which the device waited for the host within the step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.num_waits = 0
        self.wait_seconds = 0.0
        self.time_steps = False
        self.device_seconds = 0.0

    def begin(self) -> torch.cuda.Event | None:
        """With ``time_steps`` on CUDA: an event marking where a step's device work begins
        (pass it to ``start``); else None."""
        if not (self.time_steps and self.device.type == "cuda"):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(
        self, tensors: list[torch.Tensor], begun: torch.cuda.Event | None = None
    ) -> PendingRead:
        """Queue the copies of ``tensors`` to the host (no wait); ``begun`` (from
        ``begin``) times the step."""
        if self.device.type != "cuda":
            return PendingRead(list(tensors))
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        event = torch.cuda.Event(enable_timing=begun is not None)
        event.record(torch.cuda.current_stream(self.device))
        return PendingRead(host, event, begun)

    @staticmethod
    def is_done(pending: PendingRead) -> bool:
        """Whether a started read's copies have completed (asks the device, never waits)."""
        return pending.event is None or pending.event.query()

    @staticmethod
    def take(pending: PendingRead) -> list[list]:
        """Host lists of a started read whose copies have completed (``is_done``): no wait,
        so it is not counted in ``num_waits``. ValueError if they have not."""
        if not DeviceReader.is_done(pending):
            raise ValueError("take: the read's copies have not completed; ask is_done first")
        return [t.tolist() for t in pending.tensors]

    def read(self, pending: PendingRead) -> list[list]:
        """Host lists of a started read, after a single wait for its event."""
        return self.read_all([pending])[0]

    def read_all(self, pendings: list[PendingRead]) -> list[list[list]]:
        """Host lists of several reads started in this order on one stream, after a single
        wait: for the last one's event (the earlier copies were queued before it)."""
        self.num_waits += 1
        last = pendings[-1]
        if last.event is not None:
            # The one intended wait: exempt from torch's sync debug mode, which a test
            # turns on to catch every other synchronization.
            debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            start = time.perf_counter()
            try:
                last.event.synchronize()
            finally:
                self.wait_seconds += time.perf_counter() - start
                torch.cuda.set_sync_debug_mode(debug_mode)
            begun = pendings[0].begun
            if begun is not None:
                self.device_seconds += begun.elapsed_time(last.event) / 1e3
        return [[t.tolist() for t in pending.tensors] for pending in pendings]


def copy_to(destination: torch.Tensor, values) -> None:
    """Fill ``destination`` (a device buffer) from host ``values`` (a list or a numpy
    array) without a wait."""
    pinned = destination.device.type == "cuda"
    destination.copy_(_host_tensor(values, destination.dtype, pinned), non_blocking=True)
