"""Model runner: the model, its paged KV cache and CUDA graphs on one device, and the
forward pass of a step's flat inputs.

Built in two stages: the constructor loads the weights (and the MTP head), so the engine
can size the KV cache from the memory left; ``allocate_kv_cache`` then creates the cache
and, on CUDA, captures the CUDA graphs. The step pipeline (``step_pipeline.py``) drives it;
it never changes a request's lifecycle (the scheduler does).
"""

from __future__ import annotations

import functools

import torch

from tandem.config import EngineConfig
from tandem.device_copy import copy_to, to_device
from tandem.layers.attention import AttentionBackend, TorchAttentionBackend
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import load_mtp_head
from tandem.models.tensor_parallel import (
    check_process_group,
    shard_model,
    shard_mtp_head,
    validate_tensor_parallel,
)
from tandem.worker.cuda_graphs import CudaGraphRunner, GraphBatch
from tandem.worker.input_batch import StepInputs
from tandem.worker.ragged_graphs import RaggedBatch, RaggedGraphRunner, ragged_outputs_bytes
from tandem.worker.request_slots import RequestSlots
from tandem.worker.spec_decode.draft_graphs import DraftGraphRunner
from tandem.worker.spec_decode.hidden_cache import HiddenCache
from tandem.worker.spec_decode.oracle_proposer import OracleProposer
from tandem.worker.spec_decode.prompt_draft_graphs import PromptDraftGraphs
from tandem.worker.spec_decode.proposer import MTPProposer


def _attention_backend(name: str) -> AttentionBackend:
    return TritonAttentionBackend() if name == "triton" else TorchAttentionBackend()


def kv_cache_bytes_per_block(
    arch, block_size: int, dtype: torch.dtype, num_extra_layers: int = 0
) -> int:
    """Bytes that one KV block takes over all layers (keys and values), MTP layers too, and
    a head of several MTP layers' hidden states between them (``MTPProposer``)."""
    element = torch.empty((), dtype=dtype).element_size()
    hidden = HiddenCache.num_tensors(arch.hidden_size, arch.num_kv_heads, arch.head_dim)
    layers = arch.num_layers + num_extra_layers + max(num_extra_layers - 1, 0) * hidden
    return 2 * layers * block_size * arch.num_kv_heads * arch.head_dim * element


def on_runner_device(method):
    """Run ``method`` with the runner's GPU as CUDA's current device: Triton launches its
    kernels there, whatever the tensors' device (an engine on cuda:1, another on cuda:0)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


class ModelRunner:
    """The model, its KV cache and graphs on one device (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        max_model_len: int,
        mtp_source: str | None = None,
        use_mtp: bool = False,
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.resolved_dtype_name())
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        rank, world_size = config.parallel.rank, config.parallel.tensor_parallel_size
        if world_size > 1:  # fail before loading: the shapes must split, the ranks connect
            validate_tensor_parallel(files.arch, world_size, files.path)
            check_process_group(rank, world_size)
        self.model = load_model(files, max_model_len, self.dtype, self.device, config.seed)
        self.backend = _attention_backend(config.resolved_attention_backend())
        self.mtp_head = None
        if use_mtp:
            mtp_head = load_mtp_head(mtp_source, files, self.model.rotary, config.seed)
            self.mtp_head = mtp_head.to(device=self.device, dtype=self.dtype).eval()
            # The target's forward computes what such a head drafts from (with tensor
            # parallelism on every rank: the residual stream is whole, the projection too).
            if mtp_head.feature_layers:
                self.model.attach_draft_features(mtp_head.feature_layers, mtp_head.fuse_features)
        if world_size > 1:
            shard_model(self.model, rank, world_size, model_name=files.path)
            if self.mtp_head is not None:
                shard_mtp_head(self.mtp_head, rank, world_size)
        if self.device.type == "cuda":
            self.model.fuse_gate_up()  # one GEMM per MLP input on the GPU
            if self.mtp_head is not None:
                self.mtp_head.fuse_gate_up()
            # Hand the replaced weights' memory back: the KV cache is sized from what is free.
            torch.cuda.empty_cache()
        # This rank's shapes (its KV heads alone with tensor parallelism): the cache's.
        self.arch = self.model.arch
        self.kv_caches: list[torch.Tensor] = []
        self.proposer: MTPProposer | OracleProposer | None = None
        self.graphs: CudaGraphRunner | None = None
        self.ragged_graphs: RaggedGraphRunner | None = None
        self.scratch_block = 0
        max_tokens = config.scheduler.max_num_batched_tokens
        self._input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self._slots = torch.zeros(max_tokens, dtype=torch.long, device=self.device)

    @on_runner_device
    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Create the paged KV cache (``num_blocks`` blocks for requests plus one scratch
        block for CUDA graphs' padding rows) and capture the graphs unless eager."""
        self.max_model_len = max_model_len
        self.scratch_block = num_blocks  # the cache's extra block: padding rows write there
        cache_shape = (
            2,
            num_blocks + 1,
            self.block_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
        )
        self.kv_caches = [
            torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]
        k = self.config.speculative.num_speculative_tokens
        if self.mtp_head is not None:
            mtp_caches = [
                torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
                for _ in range(self.mtp_head.num_layers)
            ]
            hidden_caches = [
                HiddenCache(cache_shape, self.arch.hidden_size, self.dtype, self.device)
                for _ in range(self.mtp_head.num_layers - 1)
            ]
            self.proposer = MTPProposer(
                self.mtp_head,
                self.model,
                mtp_caches,
                self.backend,
                self.block_size,
                self.device,
                hidden_caches,
            )
        elif self.config.speculative.method == "oracle":  # benchmarks only
            self.proposer = OracleProposer(
                k,
                self.config.speculative.oracle_corruption,
                self.arch.vocab_size,
                max_model_len,
                self.device,
            )
        if self.uses_cuda_graphs:
            query_lens = [1, 1 + k] if self.proposer is not None else [1]
            self.graphs = CudaGraphRunner(
                self.model,
                self.kv_caches,
                self.backend,
                self.block_size,
                max_model_len,
                self.config.scheduler.max_num_seqs,
                query_lens,
                num_blocks,
                self.device,
            )
            self.graphs.capture()
            self.ragged_graphs = RaggedGraphRunner(self)
            self.ragged_graphs.capture()
            if self.mtp_head is not None and k > 1:
                self.proposer.graphs = DraftGraphRunner(
                    self.proposer, k, max_model_len, self.config.scheduler.max_num_seqs, num_blocks
                )
                self.proposer.graphs.capture()
            if self.mtp_head is not None and self.mtp_head.num_layers == 1:
                self.proposer.prompt_graphs = PromptDraftGraphs(
                    self.proposer, self.ragged_graphs, k
                )
                self.proposer.prompt_graphs.capture()
        if self.device.type == "cuda":
            self._warm_up_eager_steps(scratch_block=num_blocks)

    def release(self) -> None:
        """Drop the KV cache and the CUDA graphs and return their memory to the device."""
        self.graphs = self.ragged_graphs = None
        self.proposer = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_caches_with_mtp(self) -> list[torch.Tensor]:
        """Every layer's KV cache: the target's, then the MTP head's, then a head of several
        layers' hidden caches (``HiddenCache``: KV-shaped): what PD hands over."""
        if self.proposer is None:
            return list(self.kv_caches)
        hidden = getattr(self.proposer, "hidden_caches", [])
        return self.kv_caches + self.proposer.kv_caches + [t for c in hidden for t in c.tensors]

    @property
    def token_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's token ids, positions and KV slots (``max_num_batched_tokens`` long)."""
        return self._input_ids, self._positions, self._slots

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs need CUDA and the Triton backend (whose launches read no host value)."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and isinstance(self.backend, TritonAttentionBackend)
        )

    @torch.inference_mode()
    @on_runner_device
    def profile_peak_bytes(self) -> int:
        """Device memory a full step needs beyond the weights: a dry run of the largest
        prefill (``max_num_batched_tokens`` tokens) and its logits, measured on CUDA (twice
        with CUDA graphs: the ragged steps' graphs keep a private pool as large, and their
        outputs; three times with a one-layer MTP head's prompt graphs beside them), and with an
        MTP head the requests' device slots (``RequestSlots``)."""
        tokens = self.config.scheduler.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        caches = [
            torch.zeros(
                (2, blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(self.arch.num_layers)
        ]
        slots = torch.arange(tokens, device=self.device)
        metadata = self.backend.build_metadata(
            [tokens], [tokens], [list(range(blocks))], slots, self.block_size, self.device
        )
        hidden = self.model(
            self._input_ids[:tokens],
            torch.arange(tokens, device=self.device),
            caches,
            metadata,
            self.backend,
        )
        rows = min(
            tokens,
            self.config.scheduler.max_num_seqs
            * (1 + self.config.speculative.num_speculative_tokens),
        )
        self.model.compute_logits(hidden[:rows]).softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        # The head's prompt graphs keep a third pool: one layer over the same tokens and
        # the logits of at most max_num_seqs rows, so at most the peak (an estimate).
        if self.uses_cuda_graphs:
            peak *= 3 if self.mtp_head is not None and self.mtp_head.num_layers == 1 else 2
            peak += ragged_outputs_bytes(tokens, self.arch.hidden_size, self.dtype)
        del caches, hidden
        torch.cuda.empty_cache()
        if self.proposer is not None:  # the step pipeline's device slots, allocated later
            k = self.config.speculative.num_speculative_tokens
            capacity = RequestSlots.initial_capacity(self.config.scheduler.max_num_seqs)
            peak += RequestSlots.storage_bytes(k, self.arch.vocab_size, capacity)
        return peak

    @torch.inference_mode()
    def _warm_up_eager_steps(self, scratch_block: int) -> None:
        """Run a prefill alone and a prefill beside a decode row (their keys and values
        written to the scratch block only), so that the kernels of such eager steps are
        compiled now rather than in the first step that serves them."""
        block_size = self.block_size
        for query_lens in ([2 * block_size], [1, 2 * block_size]):
            positions = [p for length in query_lens for p in range(length)]
            slots = to_device(
                [scratch_block * block_size + p % block_size for p in positions],
                torch.long,
                self.device,
            )
            tables = [[scratch_block] * -(-length // block_size) for length in query_lens]
            metadata = self.backend.build_metadata(
                query_lens, query_lens, tables, slots, block_size, self.device
            )
            hidden = self.model(
                self._input_ids[: len(positions)],
                to_device(positions, torch.long, self.device),
                self.kv_caches,
                metadata,
                self.backend,
            )
            self.model.compute_logits(hidden[-1:])

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's hidden states and the fed token ids (drafts filled in on the
        device): by a CUDA graph's replay (a uniform graph, else a ragged one) when one
        fits, else eagerly."""
        fills = []  # (flat indices, token ids) written on the device after the copy
        if inputs.drafts:
            fills.append(
                (to_device(inputs.draft_index, torch.long, self.device), torch.cat(inputs.drafts))
            )
        if inputs.pending_index:
            source = inputs.pending_sources[0][0]  # one launched step at a time
            fills.append(
                (
                    to_device(inputs.pending_index, torch.long, self.device),
                    source.index_select(
                        0,
                        to_device(
                            [index for _, index in inputs.pending_sources], torch.long, self.device
                        ),
                    ),
                )
            )
        size = self.graphs.padded_size(inputs.query_lens) if self.graphs is not None else None
        if size is not None:
            batch = GraphBatch(
                inputs.token_ids,
                inputs.positions,
                inputs.slots,
                inputs.seq_lens,
                inputs.block_tables,
                inputs.query_lens[0],
            )
            return self.graphs.run(batch, size, fills)
        num_tokens = len(inputs.token_ids)
        input_ids = self._input_ids[:num_tokens]
        positions = self._positions[:num_tokens]
        slots = self._slots[:num_tokens]
        copy_to(input_ids, inputs.token_ids)
        copy_to(positions, inputs.positions)
        copy_to(slots, inputs.slots)
        for index, tokens in fills:
            input_ids[index] = tokens
        if self.ragged_graphs is not None:
            ragged = RaggedBatch(inputs.query_lens, inputs.seq_lens, inputs.block_tables)
            size = self.ragged_graphs.padded_size(ragged)
            if size is not None:
                return self.ragged_graphs.run(ragged, size), input_ids
        metadata = self.backend.build_metadata(
            inputs.query_lens,
            inputs.seq_lens,
            inputs.block_tables,
            slots,
            self.block_size,
            self.device,
        )
        return self.model(input_ids, positions, self.kv_caches, metadata, self.backend), input_ids

    def forward_resolved(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        metadata,
        query_len: int,
    ) -> torch.Tensor:
        """The target's hidden states for a uniform step whose rows the device resolved
        (every input a device tensor; ``metadata`` the step's attention metadata for the
        eager path): by a CUDA graph's replay when one fits, else eagerly."""
        rows = block_tables.shape[0]
        if self.graphs is not None and self.graphs.padded_size([query_len] * rows) is not None:
            return self.graphs.run_device(
                input_ids, positions, slot_mapping, seq_lens, block_tables, query_len
            )
        return self.model(input_ids, positions, self.kv_caches, metadata, self.backend)
