"""KV block manager: fixed-size blocks, per-request block tables, prefix caching.

Plain Python (no torch). A full block whose tokens are all computed gets a hash chained over
its prefix; later requests with the same prefix reuse it. Freed blocks with a hash stay in
the cache until they are evicted (least recently freed first) to make room.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tandem.request import Request

ROOT_HASH = b"tandem-prefix-root"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Content hash of one full block, chained over everything before it."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class KVBlock:
    """One block of KV slots: how many requests hold it and its prefix hash, if full."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Hands out KV blocks to requests and keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with no reference, in eviction order (front is evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        # Per request: how many of its leading blocks cache_full_blocks has looked at already
        # (each registered, or left private beside an identical cached block).
        self._req_num_registered: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def all_blocks_free(self) -> bool:
        """True when no request holds any block (cached blocks may remain)."""
        return len(self._free) == self.num_blocks and not self._req_blocks

    # ---- prefix cache --------------------------------------------------------------------

    def _chain_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._req_hashes.setdefault(request.request_id, [])
        tokens = None
        while len(hashes) < num_full_blocks:
            if tokens is None:
                tokens = request.all_token_ids()
            index = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            start = index * self.block_size
            hashes.append(hash_block(parent, tokens[start : start + self.block_size]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of the request, and how many tokens they cover.

        At least one token is always left to compute, so the step produces logits.
        Requests that want prompt logprobs skip the cache: cached positions have no logits.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        num_full = (request.num_tokens - 1) // self.block_size
        hashes = self._chain_hashes(request, num_full)
        hit: list[int] = []
        for block_hash in hashes[:num_full]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed, known tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        first = self._req_num_registered.get(request.request_id, 0)
        if num_full <= first:
            return  # no block became full since the last call (most decode steps)
        self._req_num_registered[request.request_id] = num_full
        hashes = self._chain_hashes(request, num_full)
        for index in range(first, num_full):
            block = self.blocks[blocks[index]]
            if block.block_hash is not None:
                continue
            block_hash = hashes[index]
            if block_hash in self._cached:
                continue  # an identical block is cached already; this one stays private
            block.block_hash = block_hash
            self._cached[block_hash] = block.block_id

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens.

        ``new_computed_blocks`` are prefix-cache hits found at admission. Returns False,
        changing nothing, when there are not enough free blocks (the caller preempts).
        """
        new_computed_blocks = new_computed_blocks or []
        held = self._req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = self.blocks_needed(total_tokens) - len(held) - len(new_computed_blocks)
        num_reusable_free = (
            sum(1 for b in new_computed_blocks if self.blocks[b].ref_count == 0)
            if new_computed_blocks
            else 0
        )
        if num_needed > len(self._free) - num_reusable_free:
            return False
        held = self._req_blocks.setdefault(request.request_id, held)
        for block_id in new_computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            held.append(block_id)
        for _ in range(max(num_needed, 0)):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            held.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references. Idempotent: freeing twice is a no-op."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_hashes.pop(request.request_id, None)
        self._req_num_registered.pop(request.request_id, None)
        if blocks is None:
            return
        # Tail blocks first, so that shared prefixes are evicted last.
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # worthless: reuse first

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
