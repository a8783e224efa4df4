"""The scheduler tests' harness: a scheduler over a small block manager, requests with
distinct made-up prompts, and a driver that feeds fake ModelRunnerOutput objects back (every
row that samples gets token ``1000 + step`` unless a test says otherwise). No model runs."""

from __future__ import annotations

import zlib

from tandem.config import SchedulerConfig
from tandem.core.kv_cache import BlockManager
from tandem.core.scheduler import Scheduler
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.step import ModelRunnerOutput, SchedulerOutput

BS = 4  # block size used throughout


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    block_manager = BlockManager(num_blocks, BS, enable_prefix_caching)
    return Scheduler(config, block_manager, max_model_len)


def make_request(request_id: str, prompt, **params) -> Request:
    if isinstance(prompt, int):
        base = zlib.crc32(request_id.encode()) % 500  # deterministic, distinct per id
        prompt = [base + i for i in range(prompt)]
    return Request(request_id, list(prompt), SamplingParams(**params))


class Driver:
    """Runs schedule -> fake runner -> update_from_output and records what happened."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.step_no = 0
        self.emitted: dict[str, list[int]] = {}

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def fake_output(self, out: SchedulerOutput, tokens=None) -> ModelRunnerOutput:
        """Sampled tokens for every row that samples (``row.samples`` before the update)."""
        sampled = {}
        for row in out.scheduled:
            if row.samples:
                rid = row.request.request_id
                if tokens is not None and rid in tokens:
                    sampled[rid] = list(tokens[rid])
                else:
                    sampled[rid] = [1000 + self.step_no]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def update(self, out: SchedulerOutput, tokens=None):
        runner_output = self.fake_output(out, tokens)
        self.step_no += 1
        return self.scheduler.update_from_output(out, runner_output)

    def step(self, tokens=None):
        out = self.schedule()
        return out, self.update(out, tokens)

    def run(self, max_steps: int = 2000, tokens=None, check=None) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished_requests():
            assert len(outs) < max_steps, "scheduler made no progress"
            out = self.schedule()
            if check is not None:
                check(out)
            self.update(out, tokens)
            outs.append(out)
        return outs


def ids(out: SchedulerOutput) -> list[str]:
    return [row.request.request_id for row in out.scheduled]
