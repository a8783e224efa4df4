"""Programmatic dependent launch (PDL) between neighbouring Triton kernels.

On Hopper and newer GPUs a kernel launched with PDL starts while the kernel before it in
the stream is still running: its programs are scheduled once every program of the one
before has signalled (``gdc_launch_dependents``), and they wait (``gdc_wait``) until that
kernel has finished and its writes are visible. The launch latency between the two hides
under the first one's tail; in a batch-1 decode step of ~300 kernels each such pair saves
about a quarter of a microsecond (benchmarks/README.md). It only pays between our own
kernels: after a cuBLAS GEMM (which never signals) a PDL launch measured slower.

Every kernel here that takes part calls :func:`pdl_prologue` first, before any load or
store, with two constexprs: ``WAIT`` (it was launched with PDL: wait for the kernel before)
and ``RELEASE`` (signal at once, so a PDL kernel after it may be scheduled). Waiting before
touching memory keeps the stream's order for every buffer, including memory the caching
allocator hands from one kernel to the next.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # tandem runs without triton
    triton = None
    tl = None


def pdl_supported(tensor: torch.Tensor) -> bool:
    """Whether a kernel on ``tensor``'s device can take part: a compiled launch (a CUDA
    tensor, not Triton's interpreter) on an NVIDIA GPU of compute capability 9.0 or newer
    (ROCm reports its own versions through the same call: never there)."""
    if triton is None or not tensor.is_cuda or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(tensor.device)[0] >= 9


def pdl_launch(tensor: torch.Tensor, after_triton: bool) -> tuple[bool, bool, dict]:
    """(``WAIT``, ``RELEASE``, the launch's extra keyword arguments) for a kernel on
    ``tensor``'s device whose input the kernel just before it wrote: launched with PDL only
    when that kernel is one of ours (``after_triton``)."""
    supported = pdl_supported(tensor)
    wait = supported and after_triton
    return wait, supported, ({"launch_pdl": True} if wait else {})


if triton is not None:

    @triton.jit
    def pdl_prologue(WAIT: tl.constexpr, RELEASE: tl.constexpr):
        """Wait for the kernel before (``WAIT``), then let the kernel after be scheduled
        (``RELEASE``); both compile to nothing when off."""
        if WAIT:
            tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
