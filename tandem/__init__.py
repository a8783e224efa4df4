"""Tandem: an LLM serving engine built around exact, fast MTP speculative decoding."""

from tandem.llm import LLM
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
