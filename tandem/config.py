"""Engine configuration: one dataclass per concern, gathered in EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheConfig:
    """Paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = 16
    # Explicit number of blocks; when None it is derived from kv_cache_memory_gb, or on
    # CUDA (when that is None too) from the memory left under gpu_memory_utilization.
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    # The KV cache's size on the CPU when neither num_blocks nor kv_cache_memory_gb is set.
    CPU_DEFAULT_GB = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class SchedulerConfig:
    """Continuous batching limits. Prefills longer than the token budget are chunked."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Filled from the model when None.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: ``mtp``, ``auto`` (MTP on CUDA when the model has a head, else
    none; made concrete when the engine loads the model), or for benchmarks only ``oracle``
    (drafts replayed from recorded greedy outputs, ``oracle_corruption`` of them corrupted).

    ``draft_schedule``: fewer drafts for larger batches (TensorRT-LLM's draft length
    schedule), pairs ``(rows, drafts)`` with rows ascending: a step resolved on the device
    over at least ``rows`` rows verifies ``drafts`` drafts per request (the largest ``rows``
    that applies wins; below the first, ``num_speculative_tokens``). Verifying k + 1 tokens
    per row costs about what one does while the GEMMs are bound by reading the weights, not
    past that (benchmarks/README.md, "The 8B shape at batch 64 on an H100")."""

    method: str | None = None
    num_speculative_tokens: int = 0
    # A Tandem head directory, "dummy" (random), or None (the checkpoint's or shipped head).
    model: str | None = None
    oracle_corruption: float = 0.0
    draft_schedule: tuple[tuple[int, int], ...] = ()

    METHODS = (None, "auto", "mtp", "oracle")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(
                f"speculative must be None, 'auto', 'mtp' or 'oracle', got {self.method!r}"
            )
        if not 0.0 <= self.oracle_corruption <= 1.0:
            raise ValueError(f"oracle_corruption must be in [0, 1], got {self.oracle_corruption}")
        if self.method and not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 8], got {self.num_speculative_tokens}"
            )
        try:
            self.draft_schedule = tuple((int(r), int(d)) for r, d in self.draft_schedule)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"draft_schedule must be (batch size, drafts) pairs, got {self.draft_schedule!r}"
            ) from error
        if self.draft_schedule and not self.method:
            raise ValueError("draft_schedule needs speculative decoding")
        rows = [rows for rows, _ in self.draft_schedule]
        if rows != sorted(set(rows)) or any(r < 1 for r in rows):
            raise ValueError(f"draft_schedule's batch sizes must be >= 1 and ascending, got {rows}")
        for _, drafts in self.draft_schedule:
            if not 1 <= drafts <= self.num_speculative_tokens:
                raise ValueError(
                    f"draft_schedule's drafts must be in [1, num_speculative_tokens = "
                    f"{self.num_speculative_tokens}], got {drafts}"
                )

    def drafts_for(self, num_rows: int) -> int:
        """The drafts per request that a resolved step of ``num_rows`` rows verifies (and
        drafts for its next step): ``draft_schedule``'s, else ``num_speculative_tokens``."""
        drafts = self.num_speculative_tokens
        for rows, scheduled in self.draft_schedule:
            if num_rows >= rows:
                drafts = scheduled
        return drafts


@dataclass
class DisaggConfig:
    """Prefill/decode disaggregation: this instance's role and how it reaches its peers.

    ``mixed`` runs whole requests. A ``prefill`` instance runs prompts that decode
    instances send it and hands over the first token, its logprobs, the MTP drafts and the
    KV blocks; a ``decode`` instance reserves the blocks, asks a prefill instance for them
    and decodes from there. Control messages go over ZeroMQ at ``control_host`` and
    ``control_port`` (0: a free port); KV blocks through ``kv_connector``: ``zmq`` (the
    default: listens only on ``control_host``, messages signed with the secret), ``mooncake``
    (TCP or RDMA; its ports listen on every interface), ``nccl`` or ``cuda_ipc``."""

    role: str = "mixed"
    kv_connector: str = "zmq"
    control_host: str = "127.0.0.1"
    control_port: int = 0
    # A decode instance ends a request with an error when its prompt's KV has not arrived
    # this long after it asked; a prefill instance starts no transfer later than that.
    transfer_timeout_s: float = 30.0
    secret: str | None = field(default=None, repr=False)  # never in a log line

    ROLES = ("mixed", "prefill", "decode")
    CONNECTORS = ("zmq", "mooncake", "nccl", "cuda_ipc")

    def __post_init__(self) -> None:
        if self.role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {self.role!r}")
        if self.kv_connector not in self.CONNECTORS:
            raise ValueError(
                f"kv_connector must be one of {self.CONNECTORS}, got {self.kv_connector!r}"
            )
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if not 0 <= self.control_port < 65536:
            raise ValueError(f"control_port must be in [0, 65535], got {self.control_port}")


@dataclass
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` processes each run a whole engine on the
    same inputs, and this one is ``rank`` among them. Only the model's layers communicate,
    over the torch.distributed process group that the caller initialised."""

    tensor_parallel_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(f"rank must be in [0, {self.tensor_parallel_size}), got {self.rank}")


@dataclass
class EngineConfig:
    """Everything the engine needs to start."""

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA
    seed: int = 0
    overlap: bool = True
    # "torch" (the reference) or "triton" (one paged-attention kernel launch per layer);
    # None picks triton on CUDA and torch on the CPU.
    attention_backend: str | None = None
    # No CUDA graphs: every step runs eagerly.
    enforce_eager: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}"
            )
        if self.parallel.tensor_parallel_size > 1 and self.disagg.role != "mixed":
            raise ValueError(
                f"role {self.disagg.role!r} with tensor_parallel_size "
                f"{self.parallel.tensor_parallel_size} is not supported yet "
                "(PD disaggregation runs one rank per instance)"
            )

    def resolved_attention_backend(self) -> str:
        """The attention backend's name: as set, else triton on CUDA and torch elsewhere."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

    def resolved_dtype_name(self) -> str:
        """The compute dtype's name: float32 on the CPU unless set, bfloat16 on CUDA."""
        if self.dtype is not None:
            name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
                self.dtype, self.dtype
            )
            if name not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
            return name
        return "bfloat16" if self.device.startswith("cuda") else "float32"
