"""The offline API in vLLM's shape: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import replace

from tandem.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.core.engine_core import EngineCore
from tandem.models.loader import resolve_model
from tandem.output_processor import OutputProcessor
from tandem.outputs import RequestOutput
from tandem.request import Request
from tandem.sampling_params import SamplingParams, check_text
from tandem.tokenizer import Tokenizer

PromptType = str | dict


def engine_config(
    model: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    speculative: str | None = None,
    num_speculative_tokens: int = 3,
    speculative_model: str | None = None,
    oracle_corruption: float = 0.0,
    speculative_draft_schedule: tuple[tuple[int, int], ...] = (),
    overlap: bool = True,
    attention_backend: str | None = None,
    enforce_eager: bool = False,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    kv_cache_memory_gb: float | None = None,
    gpu_memory_utilization: float = 0.9,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    tensor_parallel_size: int = 1,
) -> EngineConfig:
    """An EngineConfig from flat options (the offline API's and the command line's). With
    ``tensor_parallel_size`` > 1, this process's rank is torch.distributed's."""
    return EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        seed=seed,
        overlap=overlap,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        cache=CacheConfig(
            block_size,
            num_kv_blocks,
            kv_cache_memory_gb,
            enable_prefix_caching,
            gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        speculative=SpeculativeConfig(
            speculative,
            num_speculative_tokens if speculative else 0,
            speculative_model,
            oracle_corruption,
            speculative_draft_schedule if speculative else (),
        ),
        parallel=ParallelConfig(tensor_parallel_size, _distributed_rank(tensor_parallel_size)),
    )


def _distributed_rank(tensor_parallel_size: int) -> int:
    """This process's rank in the initialised process group (0 when there is none: the
    model runner then says how to start one)."""
    if tensor_parallel_size == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class LLM:
    """Runs an engine core in this process for batch generation.

    ``model`` is a GGUF file, a Hugging Face directory, ``dummy:NAME`` (random weights of a
    named architecture) or None for the default model (SmolLM2-135M-Instruct). With
    ``tensor_parallel_size=N`` every one of N processes (one torch.distributed process group,
    initialised before) builds an LLM and makes the same calls; all return the same outputs.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_options):
        """``engine_options`` are those of :func:`engine_config` (device, dtype,
        speculative, overlap, max_num_seqs, gpu_memory_utilization, ...)."""
        self.config = engine_config(model, **engine_options)
        self.engine = EngineCore(self.config)
        self.model_path = self.engine.model_path
        tokenizer_path = tokenizer or self.model_path
        if tokenizer_path.startswith("dummy:"):
            # Random weights have no vocabulary: borrow the default model's tokenizer.
            tokenizer_path = resolve_model(None)
        self.tokenizer = Tokenizer.from_model_path(tokenizer_path)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.engine.freeze_heap()  # the tokenizer too, built after the engine froze its own

    # ---- requests ------------------------------------------------------------------------

    def _prepare(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError("each prompt must be a string or {'prompt_token_ids': [...]}")

    def _with_end_tokens(self, params: SamplingParams) -> SamplingParams:
        return replace(params, eos_token_ids=self.tokenizer.end_token_ids)

    def add_request(self, prompt: PromptType, params: SamplingParams) -> str:
        """Queue one request; returns its id. Raises ValueError for bad input."""
        text, token_ids = self._prepare(prompt)
        request_id = str(next(self._ids))
        params = self._with_end_tokens(params)
        self.engine.add_request(Request(request_id, token_ids, params))
        self.processor.add_request(request_id, text, token_ids, params)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.processor.abort(request_id)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that made progress (with
        ``finished_only``, of those that finished)."""
        updates = self.engine.step()
        outputs, stopped, failed = self.processor.process(updates, finished_only=finished_only)
        for request_id, stop_string in stopped:
            self.engine.finish_request(request_id, stop_string)
        for request_id, error in failed:  # their outputs say "error"
            self.engine.scheduler.fail_request(request_id, error)
        return outputs

    # ---- batch API -----------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Every prompt is validated before any runs, so a bad one raises ValueError and
        leaves the engine as it was.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params"
            )
        prepared = [self._prepare(p) for p in prompts]
        for (_, token_ids), params in zip(prepared, sampling_params, strict=True):
            self.engine.limits.validate(token_ids, self._with_end_tokens(params))
        order = [
            self.add_request({"prompt": text, "prompt_token_ids": ids}, params)
            for (text, ids), params in zip(prepared, sampling_params, strict=True)
        ]
        return self._run_until_done(order, use_tqdm)

    def _run_until_done(self, order: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = len(order) >= 16 and not os.environ.get("PYTEST_CURRENT_TEST")
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(order), desc="Generating", unit="req", dynamic_ncols=True)
        pending = set(order)
        finished: dict[str, RequestOutput] = {}
        try:
            while pending:
                for output in self.step(finished_only=True):
                    if output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for request_id in pending:
                self.abort_request(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        if not self.engine.scheduler.has_unfinished_requests():
            # Overlap scheduling leaves the finished requests' last step in flight: settle it
            # so the engine is idle (and the runner has dropped their state) on return.
            self.engine.read_in_flight()
            self.engine.step()
        return [finished[request_id] for request_id in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.apply_chat_template(c)} for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, float]:
        """Engine counters: requests, tokens, steps, preemptions, KV and prefix-cache use."""
        return self.engine.metrics()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block no request holds: the next prompts are computed
        in full (as vLLM's ``LLM.reset_prefix_cache``)."""
        self.engine.block_manager.reset_prefix_cache()
