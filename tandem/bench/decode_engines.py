"""The engines of ``tandem bench decode``: one per mode (plain or MTP, with or without
overlap, or the oracle proposer), built from one spec, and shut down before the next one is
built so that its GPU memory is free again."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any


@dataclasses.dataclass
class EngineSpec:
    """How each mode's engine is built (beside its mode)."""

    model: str | None
    device: str
    dtype: str | None
    max_num_seqs: int
    num_speculative_tokens: int
    speculative_model: str | None
    kv_cache_memory_gb: float | None
    draft_schedule: tuple[tuple[int, int], ...] = ()  # MTP and oracle engines'

    def build(self, mode: dict) -> Any:
        """One engine for ``mode`` (the oracle's gets no recordings yet)."""
        from tandem import LLM

        extra: dict = {}
        k = self.num_speculative_tokens
        if mode.get("oracle") is not None:
            extra.update(
                speculative="oracle", num_speculative_tokens=k, oracle_corruption=mode["oracle"]
            )
        elif mode["mtp"]:
            extra.update(speculative="mtp", num_speculative_tokens=k)
            extra["speculative_model"] = self.speculative_model
        if self.draft_schedule and "speculative" in extra:
            extra["speculative_draft_schedule"] = self.draft_schedule
        if self.kv_cache_memory_gb is not None:
            extra["kv_cache_memory_gb"] = self.kv_cache_memory_gb
        return LLM(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            overlap=mode["overlap"],
            **extra,
        )


def shut_down(llms: list, device: str) -> None:
    """Shut the engines down and give their GPU memory back before the next is built:
    ``shutdown`` frees the KV cache and graphs and thaws the GC heap an engine freezes at
    start-up on CUDA, without which a dropped engine's cycles are never collected."""
    for llm in llms:
        llm.engine.shutdown()
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
