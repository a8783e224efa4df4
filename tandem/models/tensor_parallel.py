"""Tensor parallelism of a loaded Llama-family model (and its MTP head) over torch.distributed.

Every rank builds the whole model with the same weights, then keeps its share (Megatron's
split):

- attention: its query heads ``[r*Hq/N, (r+1)*Hq/N)`` and KV heads ``[r*Hkv/N, ...)`` in a
  smaller fused ``qkv_proj``; ``o_proj`` keeps the matching input columns and all-reduces
  its partial sums (``RowParallelLinear``);
- MLP: ``gate_proj``/``up_proj`` keep the rank's rows of the intermediate size,
  ``down_proj`` the matching columns plus an all-reduce;
- ``embed_tokens`` and ``lm_head``: the rank's rows of the vocabulary (padded up to a
  multiple of N). The embedding all-reduces (other ranks' tokens give zeros here); the lm
  head all-gathers, so every rank has the full ``[T, V]`` logits and samples the same tokens.

Norms, the rotary table and the MTP head's ``eh_proj`` and norms stay replicated. A rank's
KV cache holds only its KV heads: the sharded model's ``arch`` is ``rank_arch``'s, whose
shapes the cache is sized from.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.models.llama import DecoderLayer, LlamaModel
from tandem.models.mtp import MTPHead
from tandem.models.registry import ModelArchConfig


def validate_tensor_parallel(arch: ModelArchConfig, world_size: int, model_name: str) -> None:
    """Raise ValueError unless ``arch``'s heads and MLP split evenly over ``world_size``."""
    if arch.num_kv_heads % world_size:
        raise ValueError(
            f"model {model_name!r} has {arch.num_kv_heads} KV heads, which do not "
            f"divide by tensor_parallel_size {world_size}"
        )
    if arch.intermediate_size % world_size:
        raise ValueError(
            f"model {model_name!r} has intermediate size {arch.intermediate_size}, "
            f"which does not divide by tensor_parallel_size {world_size}"
        )


def rank_arch(arch: ModelArchConfig, world_size: int) -> ModelArchConfig:
    """The shapes of one rank's modules: heads and intermediate size divided by
    ``world_size``. ``vocab_size`` stays whole: the sharded lm head returns full logits."""
    return replace(
        arch,
        num_heads=arch.num_heads // world_size,
        num_kv_heads=arch.num_kv_heads // world_size,
        intermediate_size=arch.intermediate_size // world_size,
    )


# NVLink multicast (NVLS) can put a shared host's GPUs out of service: NCCL, PyTorch's
# symmetric memory and NVSHMEM must not use it unless the operator says otherwise.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def keep_nvlink_multicast_off() -> None:
    """Set ``MULTICAST_OFF``'s variables where unset, before any NCCL communicator exists."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


def init_process_group(device: str) -> str:
    """Join the process group that torchrun's variables describe (env://: MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE), unless joined already: gloo on the CPU, nccl on CUDA.
    Returns this rank's device (plain ``cuda`` becomes GPU ``LOCAL_RANK``)."""
    keep_nvlink_multicast_off()
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method="env://")
    return device


def check_rank_devices(device: str, world_size: int) -> None:
    """Raise ValueError for a device index with ``world_size`` > 1 ranks started for the
    caller (``tandem serve``): rank r runs on cuda:r."""
    if world_size > 1 and device.startswith("cuda:"):
        raise ValueError(
            f"device {device!r} with tensor_parallel_size {world_size}: give "
            "plain 'cuda' (rank r runs on cuda:r)"
        )


def join_torchrun_group(device: str, tensor_parallel_size: int) -> tuple[str, int]:
    """For a command run by torchrun, one process per rank: with ``tensor_parallel_size`` > 1
    join the group (``init_process_group``) and return this rank's device and rank;
    otherwise ``(device, 0)``."""
    if tensor_parallel_size <= 1:
        return device, 0
    device = init_process_group(device)
    return device, dist.get_rank()


def check_process_group(rank: int, world_size: int) -> None:
    """Raise RuntimeError unless torch.distributed is initialised with ``world_size``
    processes of which this one is ``rank``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"tensor_parallel_size {world_size} needs torch.distributed initialised first: "
            "start one process per rank (torchrun, or MASTER_ADDR, MASTER_PORT, RANK and "
            "WORLD_SIZE set) and call torch.distributed.init_process_group (gloo on the CPU, "
            "nccl on CUDA) before building the engine"
        )
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks and this is rank "
            f"{dist.get_rank()}, but the engine was configured for rank {rank} of {world_size}"
        )


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value``: what all ranks can agree on (the KV cache's
    block count, which must be equal for the schedulers to stay in lockstep)."""
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's share of the input features: its output is a partial
    sum, all-reduced over ``group`` (a bias, if any, is held by rank 0 alone)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """The rows ``[vocab_start, vocab_start + len(weight))`` of an embedding table: tokens
    outside them embed to zeros here, and the all-reduce adds the owning rank's row."""

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, group: dist.ProcessGroup | None = None
    ):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """The lm head's rows of one vocabulary shard; ``forward`` gathers every rank's logits in
    rank order and drops the padding, so each rank returns the full ``[T, vocab_size]``."""

    def __init__(
        self,
        weight: nn.Parameter,
        vocab_size: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.world_size = world_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        shards = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(shards, local, group=self.group)
        return torch.cat(shards, dim=-1)[..., : self.vocab_size]


@torch.no_grad()
def shard_model(
    model: LlamaModel,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    model_name: str | None = None,
) -> None:
    """Keep ``rank``'s share of a loaded model, in place (see the module docstring); a tied
    lm head stays tied to the sharded embedding. Raises ValueError (naming ``model_name``, or
    the architecture) when the model does not split over ``world_size`` ranks."""
    arch = model.arch
    validate_tensor_parallel(arch, world_size, model_name or arch.architecture)
    requires_grad = model.embed_tokens.weight.requires_grad
    tied = model.lm_head.weight is model.embed_tokens.weight
    shard, start = _vocab_shard(model.embed_tokens.weight, rank, world_size)
    embed_weight = nn.Parameter(shard, requires_grad=requires_grad)
    model.embed_tokens = VocabParallelEmbedding(embed_weight, start, group)
    head_weight = (
        embed_weight
        if tied
        else nn.Parameter(
            _vocab_shard(model.lm_head.weight, rank, world_size)[0], requires_grad=requires_grad
        )
    )
    model.lm_head = VocabParallelLMHead(head_weight, arch.vocab_size, world_size, group)
    for layer in model.layers:
        _shard_decoder_layer(layer, rank, world_size, group)
    model.arch = rank_arch(arch, world_size)


@torch.no_grad()
def shard_mtp_head(
    head: MTPHead, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Keep ``rank``'s share of each MTP layer's decoder block, in place; ``eh_proj`` and the
    norms stay replicated (the head shares the sharded model's embedding and lm head)."""
    validate_tensor_parallel(head.arch, world_size, head.arch.architecture)
    for layer in head.layers:
        _shard_decoder_layer(layer.block, rank, world_size, group)
    head.arch = rank_arch(head.arch, world_size)


def _shard_decoder_layer(
    layer: DecoderLayer, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> None:
    """Keep ``rank``'s heads of the attention and its share of the MLP, in place (the
    caller has checked that they divide)."""
    attn = layer.self_attn
    sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    qkv = attn.qkv_proj
    attn.qkv_proj = _linear(
        _rank_rows(qkv.weight, sizes, rank, world_size),
        None if qkv.bias is None else _rank_rows(qkv.bias, sizes, rank, world_size),
        qkv.weight.requires_grad,
    )
    attn.o_proj = _row_parallel(attn.o_proj, rank, world_size, group)
    attn.num_heads //= world_size
    attn.num_kv_heads //= world_size
    attn.q_size //= world_size
    attn.kv_size //= world_size
    mlp = layer.mlp
    for name in ("gate_proj", "up_proj"):
        linear = getattr(mlp, name)
        setattr(
            mlp,
            name,
            _linear(
                _rank_rows(linear.weight, [linear.out_features], rank, world_size),
                None,
                linear.weight.requires_grad,
            ),
        )
    mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size, group)


def _rank_rows(tensor: torch.Tensor, sizes: list[int], rank: int, world_size: int) -> torch.Tensor:
    """Of each consecutive piece of ``tensor``'s rows (``sizes``), the rank's 1/N: a copy,
    so the full tensor can be freed."""
    return torch.cat([piece.chunk(world_size)[rank] for piece in tensor.split(sizes)])


def _row_parallel(
    linear: nn.Linear, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> RowParallelLinear:
    weight = linear.weight.chunk(world_size, dim=1)[rank].clone(
        memory_format=torch.contiguous_format
    )
    bias = linear.bias if linear.bias is not None and rank == 0 else None  # added once
    return RowParallelLinear(_linear(weight, bias, linear.weight.requires_grad), group)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An nn.Linear holding exactly these tensors (no initialisation, nothing allocated)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.clone(), requires_grad=requires_grad)
    return linear


def _vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """The rank's rows of a [vocab, hidden] table padded to ceil(vocab / N) rows with zeros,
    and the vocabulary index of its first row."""
    rows = -(-weight.shape[0] // world_size)
    start = rank * rows
    part = weight[start : start + rows]
    shard = weight.new_zeros((rows, weight.shape[1]))
    shard[: part.shape[0]] = part
    return shard, start
