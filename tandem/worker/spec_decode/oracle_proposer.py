"""Benchmark only: a proposer that drafts the target's own recorded greedy continuation, each
draft corrupted at a set rate, so speculative decoding's speed can be measured at a known
acceptance length on a model without a trained MTP head (``speculative="oracle"``).

The benchmark first decodes its prompts without speculation and hands the outputs over
(``set_recordings``, keyed by the prompt's token ids). When a request first drafts, its
recording is written into a device table row of the request's slot, indexed by absolute
position, beside the request's key (a CRC of its prompt). A request whose last known token
sits at position p drafts the table's tokens at p+1..p+k; draft j is replaced by another
token when a hash of (the key, its position, j) falls under the corruption rate. The key
makes each request's corruptions its own: keyed by position alone, every request of a run
would share one pattern (a sample of a few hundred positions, whose rate strays from the
set one by several points). A draft is accepted only if every draft before it is, so with rate r
the expected acceptance length is 1 + sum over j = 1..k of (1 - r)^j (the target following
its recording). Past the recording (and without one) the table holds token 0, drafted
(and corrupted) like any other.

Drafting after a resolved step (``propose_uniform``) is a gather and a few integer ops on
static tensors: a resolved step's CUDA graph records it as it is.
"""

from __future__ import annotations

import zlib

import torch

from tandem.device_copy import to_device
from tandem.sampling_params import SamplingParams
from tandem.worker.input_batch import InputBatch
from tandem.worker.spec_decode.draft_sampling import one_hot_probs
from tandem.worker.spec_decode.proposer import Proposal, ProposalRow

_HASH_BITS = 24
_MASK32 = 0xFFFFFFFF


def corruption_hash(
    positions: torch.Tensor, draft_index: torch.Tensor, keys: torch.Tensor | int = 0
) -> torch.Tensor:
    """A deterministic hash in [0, 2^24) of each (request key, position, draft index)
    (int64 tensors that broadcast; keys in [0, 2^32)). Every product stays below 2^63: no
    overflow on any device."""
    x = (keys * 0x2545F491 + positions * 0x27D4EB2F + (draft_index + 1) * 0x165667B1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    return x & ((1 << _HASH_BITS) - 1)


def request_key(prompt_token_ids: tuple[int, ...]) -> int:
    """A request's corruption key: the CRC-32 of its prompt (the same in every run)."""
    return zlib.crc32(repr(prompt_token_ids).encode())


def expected_acceptance_length(corruption: float, num_drafts: int) -> float:
    """1 + the expected number of leading drafts that are not corrupted."""
    kept = 1.0 - corruption
    return 1.0 + sum(kept**j for j in range(1, num_drafts + 1))


class OracleProposer:
    """Drafts recorded continuations with a set corruption rate (see the module docstring)."""

    resolves_on_device = True
    # Its ``propose_uniform`` is plain tensor work: a resolved step's graph records it.
    uniform_in_graph = True
    head = None  # no MTP head, no head KV cache, no draft graphs
    graphs = None

    def __init__(
        self,
        num_drafts: int,
        corruption: float,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
    ):
        if not 0.0 <= corruption <= 1.0:
            raise ValueError(f"oracle_corruption must be in [0, 1], got {corruption}")
        self.num_drafts, self.corruption = num_drafts, corruption
        self.vocab_size, self.device = vocab_size, device
        self.kv_caches: list[torch.Tensor] = []
        # Hashes under this are corrupted: 0 never, 2^24 always.
        self.threshold = round(corruption * (1 << _HASH_BITS))
        # Positions up to a resolved row's furthest draft (clamped there beyond).
        self.width = max_model_len + 2 * num_drafts + 2
        self.draft_index = torch.arange(num_drafts, device=device)
        self.table = torch.zeros((1, self.width), dtype=torch.long, device=device)
        self.keys = torch.zeros(1, dtype=torch.long, device=device)  # per slot
        self.recordings: dict[tuple[int, ...], list[int]] = {}
        self.batch: InputBatch | None = None
        self.owners: dict[int, str] = {}  # slot -> the request whose recording its row holds
        self.num_recorded_requests = 0  # requests that drafted from a recording
        self.num_unrecorded_requests = 0  # and those that found none (drafting token 0)

    def set_recordings(self, recordings: dict[tuple[int, ...], list[int]]) -> None:
        """The greedy outputs to replay: prompt token ids -> the tokens that follow them."""
        self.recordings = {tuple(prompt): list(tokens) for prompt, tokens in recordings.items()}
        self.owners.clear()

    def bind_batch(self, batch: InputBatch) -> None:
        """The pipeline's request states (prompts, slots); the table gets a row per slot."""
        self.batch = batch
        self._grow(batch.slots.capacity)

    def _grow(self, rows: int) -> None:
        """A row for every slot (slots grew: step graphs on the old table are stale too)."""
        if rows > self.table.shape[0]:
            grown = torch.zeros((rows, self.width), dtype=torch.long, device=self.device)
            grown[: self.table.shape[0]] = self.table
            self.table = grown
            keys = torch.zeros(rows, dtype=torch.long, device=self.device)
            keys[: self.keys.shape[0]] = self.keys
            self.keys = keys

    def _write_row(self, request_id: str) -> int:
        """The request's slot, its row holding the request's recording (written the first
        time the request drafts in that slot)."""
        state = self.batch.states[request_id]
        slot = state.slot
        if self.owners.get(slot) == request_id:
            return slot
        self._grow(self.batch.slots.capacity)
        self.table[slot].zero_()
        prompt_len = state.num_prompt_tokens
        prompt = tuple(state.token_ids[:prompt_len])
        # From pinned memory: a Python int assigned into a CUDA tensor waits for the device.
        self.keys[slot : slot + 1].copy_(to_device([request_key(prompt)], torch.long, self.device))
        recording = self.recordings.get(prompt)
        if recording is None:
            self.num_unrecorded_requests += 1
        else:
            self.num_recorded_requests += 1
            tokens = recording[: self.width - prompt_len]
            if tokens:
                self.table[slot, prompt_len : prompt_len + len(tokens)] = to_device(
                    tokens, torch.long, self.device
                )
        self.owners[slot] = request_id
        return slot

    def drafts(self, slot_ids: torch.Tensor, last_positions: torch.Tensor) -> torch.Tensor:
        """``[rows, k]`` drafts of requests in ``slot_ids`` whose last known tokens sit at
        ``last_positions``: the recorded tokens after them, corrupted by the hash."""
        positions = last_positions[:, None] + 1 + self.draft_index
        index = slot_ids[:, None] * self.width + positions.clamp(max=self.width - 1)
        tokens = self.table.view(-1).index_select(0, index.reshape(-1)).view(index.shape)
        keys = self.keys.index_select(0, slot_ids)[:, None]
        corrupted = corruption_hash(positions, self.draft_index, keys) < self.threshold
        return torch.where(corrupted, (tokens + 1) % self.vocab_size, tokens)

    def propose(
        self,
        rows: list[ProposalRow],
        target_hidden: torch.Tensor,
        sampling: dict[str, tuple[SamplingParams, int]],
        sampled: tuple[list[int], torch.Tensor] | None = None,
    ) -> Proposal:
        """Drafts after a step (``MTPProposer.propose``'s contract): a drafting row's newest
        token sits one past its last kept position. The drafts are deterministic (the
        recording's, whatever the tokens ``sampled`` names): a sampled request's q is
        one-hot on them (``one_hot_probs``)."""
        proposal = Proposal({}, {})
        drafting = [r for r in rows if r.positions and r.num_drafts > 0]
        if not drafting:
            return proposal
        slot_ids = [self._write_row(r.request_id) for r in drafting]
        drafts = self.drafts(
            to_device(slot_ids, torch.long, self.device),
            to_device([r.positions[-1] + 1 for r in drafting], torch.long, self.device),
        )
        for index, row in enumerate(drafting):
            row_drafts = drafts[index, : row.num_drafts]
            proposal.draft_token_ids[row.request_id] = row_drafts
            if not sampling[row.request_id][0].greedy:
                proposal.draft_probs[row.request_id] = one_hot_probs(row_drafts, self.vocab_size)
        return proposal

    def propose_uniform(
        self,
        target_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        rows,
        metadata,
        accepted,
        block_tables: torch.Tensor,
        host_block_tables: list[list[int]],
        num_drafts: int,
        slot_ids: torch.Tensor | None = None,
        sampling=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts ``[rows, num_drafts]`` after a uniform verification step, on the device
        alone: row b's new last token sits at ``accepted.last_positions[b]`` + 1;
        ``slot_ids`` name the rows' table rows (required here). Sampled rows draft the same
        tokens; with any (``sampling`` not all greedy) their q comes back one-hot."""
        if slot_ids is None:
            raise ValueError("the oracle proposer needs the rows' slot_ids")
        drafts = self.drafts(slot_ids, accepted.last_positions + 1)[:, :num_drafts]
        if sampling is None or sampling.batch.all_greedy:
            return drafts, None
        return drafts, one_hot_probs(drafts, self.vocab_size)
