"""Keyed randomness: every random number that sampling uses is a pure function of a request's
seed, an absolute token position, a draw kind and a vocabulary column, computed with integer
tensor ops on the tensors' own device. There is no generator state: a CUDA graph's replay
draws exactly what the eager path draws (seeds and positions are tensors), and a request
draws the same numbers alone or in any batch, however the steps around it are shaped.

The hash works on 32-bit words held in int64 tensors. Every intermediate value stays below
2**63 (no signed overflow, shifts of non-negative values only), so the CPU and CUDA compute
the same bits. Its round ``mix32`` is the lowbias32 bijection of 32-bit words (an
xorshift-multiply found by Chris Wellons' hash-prospector):
``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16`` (mod 2**32).

- Row key: two lanes start from ``mix32(lane constant ^ draw)`` (on the host: the draw is
  a Python int) and absorb the words (seed's low 32 bits, seed's high 31 bits, position)
  one at a time, ``h = mix32(h ^ word)``; the lanes (a, b) are a 64-bit key of (seed,
  position, draw). Keys that differ in one word never collide (each step is a bijection).
- Column c of a row keyed (a, b): ``x = mix32(mix32(c ^ a) ^ b)``, a bijection of c for a
  fixed key, so the numbers of one row are all distinct (no ties in an exponential race).

From each 32-bit x: ``u = (x + 0.5) / 2**32``, uniform on the open interval (0, 1) with
32 bits (exact in float64), and ``-log(u)``, exponential (from 1.2e-10 to 22.9, never 0).
"""

from __future__ import annotations

import random

import torch

MASK32 = 0xFFFFFFFF
SEED_BITS = 63  # seeds are non-negative int64 values

# Draw kinds: the numbers of different kinds at one (seed, position) are independent.
# TOKEN: the exponential noise that decides the token at a position, whichever way it is
# decided there: a plain sample, the residual draw after the draft at that position is
# rejected, or the bonus draw after every draft before it was accepted (one of the three
# happens at a position, once its earlier tokens are final).
TOKEN = 0
# ACCEPT: the uniform of the acceptance test of the draft at a position.
ACCEPT = 1
# DRAFT + d: the MTP head's sampled draft at depth d (see ``draft_draw``).
DRAFT = 2

_MUL_1 = 0x7FEB352D  # below 2**31: a 32-bit word times it stays below 2**63
_MUL_2_LOW = 0x846CA68B - (1 << 31)  # the second multiplier without its top bit
_LANE_STARTS = (0x6A09E667, 0xBB67AE85)  # the first two words of SHA-256's initial state


def draft_draw(depth: int) -> int:
    """The draw kind of the MTP head's sampled draft at ``depth`` (0 = the first draft)."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return DRAFT + depth


def mix32_int(x: int) -> int:
    """:func:`mix32` of one 32-bit word on the host."""
    x ^= x >> 16
    x = (x * _MUL_1) & MASK32
    x ^= x >> 15
    x = (x * (_MUL_2_LOW + (1 << 31))) & MASK32
    return x ^ (x >> 16)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 bijection of 32-bit words held in an int64 tensor (a new tensor)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    # x * 0x846CA68B mod 2**32 without overflow: the multiplier's top bit adds (x & 1) << 31,
    # which flips bit 31 when x is odd.
    x = (x * _MUL_2_LOW).bitwise_xor_(x << 31).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, draw: int) -> torch.Tensor:
    """The 64-bit key of each row's (seed, position, draw): ``[2, R]`` 32-bit words."""
    if seeds.dtype != torch.long or positions.dtype != torch.long:
        raise ValueError(
            f"seeds and positions must be int64 tensors, got {seeds.dtype} and {positions.dtype}"
        )
    if seeds.dim() != 1 or seeds.shape != positions.shape:
        raise ValueError(
            f"seeds and positions must be 1-D of one length, got shapes "
            f"{tuple(seeds.shape)} and {tuple(positions.shape)}"
        )
    if not 0 <= draw <= MASK32:
        raise ValueError(f"draw must be a 32-bit kind, got {draw}")
    low = seeds & MASK32
    lanes = mix32(torch.stack([low ^ mix32_int(start ^ draw) for start in _LANE_STARTS]))
    lanes = mix32(lanes.bitwise_xor_((seeds >> 32).bitwise_and_(0x7FFFFFFF)))
    return mix32(lanes.bitwise_xor_(positions & MASK32))


def keyed_bits(seeds: torch.Tensor, positions: torch.Tensor, draw: int, width: int) -> torch.Tensor:
    """32 random bits per (row, column): ``[R, width]`` int64 values in [0, 2**32), column c
    of row r a function of (seeds[r], positions[r], draw, c) alone."""
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    keys = row_keys(seeds, positions, draw)
    columns = torch.arange(width, dtype=torch.long, device=seeds.device)
    x = mix32(columns[None, :] ^ keys[0][:, None])
    return mix32(x.bitwise_xor_(keys[1][:, None]))


def keyed_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, draw: int, width: int
) -> torch.Tensor:
    """Uniforms on the open interval (0, 1), ``[R, width]`` float64 with 32 random bits
    each: ``(x + 0.5) / 2**32`` of :func:`keyed_bits`."""
    x = keyed_bits(seeds, positions, draw, width).double()
    return x.add_(0.5).mul_(2.0**-32)


def keyed_exponential(
    seeds: torch.Tensor, positions: torch.Tensor, draw: int, width: int
) -> torch.Tensor:
    """Standard exponentials ``-log(u)`` of :func:`keyed_uniform`'s u, ``[R, width]`` fp32
    (the log in fp64, so the small values that win an exponential race keep their 32-bit
    resolution)."""
    return keyed_uniform(seeds, positions, draw, width).log_().neg_().float()


def request_seed(seed: int | None, source: random.Random) -> int:
    """A request's 63-bit key seed: its own ``seed`` reduced mod 2**63, or, for an unseeded
    request, the next 63 bits of the worker's host ``source`` (seeded by the engine's seed,
    so a run is reproducible and every tensor-parallel rank, seeing requests in the same
    order, draws the same)."""
    if seed is None:
        return source.getrandbits(SEED_BITS)
    return seed % (1 << SEED_BITS)
