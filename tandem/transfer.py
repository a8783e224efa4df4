"""Host <-> device copies that never stall the host behind the device's queue.

A plain ``torch.tensor(values, device="cuda")`` waits for every kernel queued before it;
the engine's step loop must not. Host-to-device copies go through pinned memory without
blocking; device-to-host reads are gathered into one :class:`DeviceReader` wait per step.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A device tensor of host ``values`` (a list or a host tensor), copied without a wait."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(dtype)
    return host.to(dtype).pin_memory().to(device, non_blocking=True)


class DeviceReader:
    """The one place where the host waits for the device: ``read`` copies a step's result
    tensors to the host and waits once. ``num_waits`` counts the waits (tests and metrics
    check that a step waits at most once)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.num_waits = 0

    def read(self, tensors: list[torch.Tensor]) -> list[list]:
        """Host lists of ``tensors``, after a single wait for the device."""
        self.num_waits += 1
        if self.device.type == "cuda":
            host = [t.to("cpu", non_blocking=True) for t in tensors]
            # The one intended wait: exempt from torch's sync debug mode, which a test
            # turns on to catch every other synchronization.
            debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                torch.cuda.current_stream(self.device).synchronize()
            finally:
                torch.cuda.set_sync_debug_mode(debug_mode)
        else:
            host = tensors
        return [t.tolist() for t in host]


def copy_to(destination: torch.Tensor, values: list) -> None:
    """Fill ``destination`` (a device buffer) from host ``values`` without a wait."""
    host = torch.tensor(values, dtype=destination.dtype)
    if destination.device.type == "cuda":
        host = host.pin_memory()
    destination.copy_(host, non_blocking=True)
