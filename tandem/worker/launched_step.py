"""A step whose device work is queued and whose results the host has not read yet: what
``StepPipeline`` keeps between a step's launch and its read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.device_copy import PendingRead
from tandem.layers.sampler import LogprobsTensors
from tandem.step import ModelRunnerOutput
from tandem.worker.input_batch import RowPlan, StepInputs
from tandem.worker.spec_decode.proposer import Proposal
from tandem.worker.step_sampler import SamplingRow, StepSample


@dataclass
class LaunchedStep:
    """A step whose device work is queued and whose results the host has not read yet."""

    inputs: StepInputs
    sampling_plans: list[RowPlan]
    sampling_rows: list[SamplingRow]
    sample: StepSample | None
    prompt_logprobs: LogprobsTensors | None
    reads: PendingRead | None  # the step's results on their way to the host
    hidden: torch.Tensor | None  # the target's hidden states (drafting at the read)
    output: ModelRunnerOutput
    advanced: bool  # request states were advanced at launch (plain decoding)
    resolved: bool = False  # an MTP step resolved on the device (drafted at launch)
    drafted: Proposal | None = None  # a ragged MTP step's drafts, made at its launch
    # MTP: the next part of the same step (StepPipeline's module docstring: the joining
    # prompts, then the parts launched after the read of the step in front of it); the
    # parts are read together.
    rest: LaunchedStep | None = None

    def keep_hidden(self) -> None:
        """Before another ragged part replays a graph while this step (and the parts chained
        on it) is unread: its hidden states may be a view of that graph's static output,
        which its drafting at the read still needs, so they become a copy of their own
        (queued on the stream before the replay)."""
        part: LaunchedStep | None = self
        while part is not None:
            if part.hidden is not None:
                part.hidden = part.hidden.clone()
            part = part.rest
