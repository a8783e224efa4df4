"""Tandem: an LLM serving engine built around exact, fast MTP speculative decoding.

The offline API's names load on first use, so that importing a torch-free module of the
package (the scheduler, the block manager, the step messages) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it.
_PUBLIC = {
    "LLM": "tandem.llm",
    "CompletionOutput": "tandem.outputs",
    "Logprob": "tandem.outputs",
    "RequestOutput": "tandem.outputs",
    "SamplingParams": "tandem.sampling_params",
}

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from tandem.llm import LLM
    from tandem.outputs import CompletionOutput, Logprob, RequestOutput
    from tandem.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
