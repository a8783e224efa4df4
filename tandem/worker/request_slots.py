"""Per-request state on the device, so that a speculative step can be launched before the
step in front of it has been read.

Each running request with an MTP head owns one slot: the position of its last known token
(where its next verification row starts), that token, the k drafts to verify after it, and
for a sampled request the distributions q [k, V] the drafts were drawn from (rejection
sampling needs them: ``spec_decode/draft_sampling.py``).
Every MTP step writes its rows' slots on the device, in stream order (verification moves
``next_start`` and ``last_token`` on by the accepted count, drafting fills ``drafts``), so a
step queued behind it reads what the step before it will have written, without the host
knowing the accepted counts yet. Slot 0 is the scratch slot of padding rows. Slots grow on
demand (``generation`` counts the growths: CUDA graphs captured on the old storage are stale
after one); a freed slot is reused only once no launched step can still touch it (the
caller frees it after reading that step).
"""

from __future__ import annotations

import torch

from tandem.device_copy import to_device


class RequestSlots:
    """The device slots of one worker's requests (see the module docstring)."""

    scratch = 0  # the slot of padding rows, never assigned to a request

    def __init__(self, num_drafts: int, vocab_size: int, device: torch.device, capacity: int = 8):
        self.num_drafts = num_drafts
        self.device = device
        self.next_start = torch.zeros(capacity, dtype=torch.long, device=device)
        self.last_token = torch.zeros(capacity, dtype=torch.long, device=device)
        self.drafts = torch.zeros((capacity, num_drafts), dtype=torch.long, device=device)
        self.draft_probs = torch.zeros(
            (capacity, num_drafts, vocab_size), dtype=torch.float32, device=device
        )
        self._free = list(range(capacity - 1, 0, -1))
        self.generation = 0

    @staticmethod
    def initial_capacity(max_num_seqs: int) -> int:
        """Slots for every running request, the ones ending and the scratch slot."""
        return 2 * max_num_seqs + 2

    @staticmethod
    def storage_bytes(num_drafts: int, vocab_size: int, capacity: int) -> int:
        """The device bytes of ``capacity`` slots (the drafts' distributions dominate)."""
        return capacity * (8 * (2 + num_drafts) + 4 * num_drafts * vocab_size)

    @property
    def capacity(self) -> int:
        return self.next_start.shape[0]

    def assign(self) -> int:
        """A free slot (the storage doubles when none is left)."""
        if not self._free:
            old = self.capacity
            self.next_start = torch.cat([self.next_start, torch.zeros_like(self.next_start)])
            self.last_token = torch.cat([self.last_token, torch.zeros_like(self.last_token)])
            self.drafts = torch.cat([self.drafts, torch.zeros_like(self.drafts)])
            self.draft_probs = torch.cat([self.draft_probs, torch.zeros_like(self.draft_probs)])
            self._free = list(range(2 * old - 1, old - 1, -1))
            self.generation += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Give ``slot`` back (no launched step may still touch it)."""
        self._free.append(slot)

    def write(
        self,
        slots: list[int],
        starts: list[int],
        last_tokens: list[int] | torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Set slots from host values (``last_tokens`` may be on the device) and device
        drafts [len(slots), k], and the distributions [k, V] of sampled drafts by slot
        (``draft_probs``; no wait)."""
        host = [slots, starts] + ([] if isinstance(last_tokens, torch.Tensor) else [last_tokens])
        values = to_device(host, torch.long, self.device)  # one copy: [2 or 3, len(slots)]
        index = values[0]
        self.next_start.index_copy_(0, index, values[1])
        self.last_token.index_copy_(0, index, values[2] if len(host) == 3 else last_tokens)
        self.drafts.index_copy_(0, index, drafts)
        if draft_probs:
            self.draft_probs.index_copy_(
                0,
                to_device(list(draft_probs), torch.long, self.device),
                torch.stack(list(draft_probs.values())).float(),
            )
