"""Hugging Face transformers as a reference: load the same model and generate greedily.

Used to check Tandem's greedy outputs and logprobs, and as the baseline of the throughput
benchmark. ``transformers`` is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tandem.models.loader import DUMMY_PREFIX
from tandem.models.registry import dummy_preset

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def torch_dtype(name: str | None, device: str = "cpu") -> torch.dtype:
    """The torch dtype for a name such as "bf16"; None (or "auto") is Tandem's default:
    float32 on the CPU, bfloat16 on CUDA."""
    if name is None or name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}, expected one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def load_hf_model(model_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A transformers causal LM in eval mode, from a ``.gguf`` file, an HF model directory or
    ``dummy:NAME`` (that preset's shape with transformers' own random weights: for speed
    comparisons only).

    GGUF weights are de-quantized by transformers to ``dtype``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path.startswith(DUMMY_PREFIX):
        hf_config = dummy_preset(model_path.removeprefix(DUMMY_PREFIX)).to_hf_config()
        config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(model_path)),
            gguf_file=os.path.basename(model_path),
            dtype=dtype,
        )
    elif os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        raise ValueError(f"model_path must be a .gguf file or an HF directory, got {model_path!r}")
    return model.to(device).eval()


def _eos_list(model: Any, eos_token_ids: int | Iterable[int] | None) -> list[int]:
    """End tokens as a list; None means the model's generation config's."""
    if eos_token_ids is None:
        eos_token_ids = model.generation_config.eos_token_id
    if eos_token_ids is None:
        return []
    if isinstance(eos_token_ids, int):
        return [eos_token_ids]
    return [int(t) for t in eos_token_ids]


def _pad_id(model: Any, eos: Sequence[int]) -> int:
    """A token id to pad with (masked out, so its value does not matter)."""
    pad = model.generation_config.pad_token_id
    if isinstance(pad, int):
        return pad
    return eos[0] if eos else 0


@contextlib.contextmanager
def _only_these_end_tokens(model: Any, eos: Sequence[int]):
    """generate() falls back to the model's own EOS when given none: hide it meanwhile."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = list(eos) or None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def left_pad(
    prompt_ids_list: Sequence[Sequence[int]], pad_id: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and the matching ``attention_mask`` for a batch of prompts."""
    if not prompt_ids_list or any(len(p) == 0 for p in prompt_ids_list):
        raise ValueError("prompt_ids_list must hold at least one prompt, none of them empty")
    width = max(len(p) for p in prompt_ids_list)
    ids = torch.full((len(prompt_ids_list), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids_list), width), dtype=torch.long)
    for row, prompt in enumerate(prompt_ids_list):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def greedy_config(
    max_new_tokens: int,
    eos: Sequence[int],
    pad_id: int,
    min_new_tokens: int = 0,
    output_logits: bool = False,
) -> Any:
    """A GenerationConfig for plain greedy decoding with no logits processors.

    It is built from scratch, so a model's own generation defaults (repetition penalty and
    the like) cannot change which token is picked.
    """
    from transformers import GenerationConfig

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=list(eos) or None,
        pad_token_id=pad_id,
        use_cache=True,
        return_dict_in_generate=output_logits,
        output_logits=output_logits,
    )


@torch.inference_mode()
def hf_generate_ids(
    model: Any,
    prompt_ids_list: Sequence[Sequence[int]],
    max_new_tokens: int,
    min_new_tokens: int = 0,
    eos_token_ids: int | Iterable[int] | None = None,
) -> torch.Tensor:
    """Greedy ``model.generate`` on one left-padded batch; returns only the new token ids.

    With ``min_new_tokens == max_new_tokens`` every row gets exactly ``max_new_tokens``
    tokens (end tokens are suppressed), which is how the throughput baseline ignores EOS.
    """
    eos = _eos_list(model, eos_token_ids)
    pad_id = _pad_id(model, eos)
    ids, mask = left_pad(prompt_ids_list, pad_id, model.device)
    config = greedy_config(max_new_tokens, eos, pad_id, min_new_tokens=min_new_tokens)
    with _only_these_end_tokens(model, eos):
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, ids.shape[1] :]


@torch.inference_mode()
def hf_greedy_generate(
    model: Any,
    prompt_ids_list: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: int | Iterable[int] | None,
    batch_size: int = 1,
) -> list[dict]:
    """Greedy reference outputs with the logprobs of the raw (unprocessed) logits.

    Returns, per prompt, ``{"token_ids", "logprobs", "top2"}``: the generated ids cut after
    the first end token (which is kept), the log-softmax of the raw logits at each chosen
    token, and the two highest logprobs at each position. ``eos_token_ids=None`` uses the
    model's own end tokens.

    ``batch_size`` defaults to 1: a left-padded batch gives the same tokens but logprobs that
    differ slightly (different matmul shapes and masked attention), and a reference should
    not depend on what it was batched with. Raises ValueError if generate ever picks a token
    that is not the argmax of the raw logits (a logits processor was active).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    eos = _eos_list(model, eos_token_ids)
    pad_id = _pad_id(model, eos)
    config = greedy_config(max_new_tokens, eos, pad_id, output_logits=True)
    results: list[dict] = []
    for start in range(0, len(prompt_ids_list), batch_size):
        batch = prompt_ids_list[start : start + batch_size]
        ids, mask = left_pad(batch, pad_id, model.device)
        with _only_these_end_tokens(model, eos):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        new_tokens = out.sequences[:, ids.shape[1] :].tolist()
        # (batch, steps, vocab) log-probabilities of the raw logits.
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(dim=-1)
        top = logprobs.topk(2, dim=-1).values.tolist()
        for row, tokens in enumerate(new_tokens):
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            tokens = tokens[:cut]
            chosen = logprobs[row, torch.arange(cut), torch.tensor(tokens)].tolist()
            top2 = [(lp1, lp2) for lp1, lp2 in top[row][:cut]]
            for step, (lp, (lp1, _)) in enumerate(zip(chosen, top2, strict=True)):
                if lp < lp1:
                    raise ValueError(
                        f"HF generate picked token {tokens[step]} at step {step} of prompt "
                        f"{start + row} with logprob {lp} < the best {lp1}: not greedy"
                    )
            results.append({"token_ids": tokens, "logprobs": chosen, "top2": top2})
    return results


def reference_from_output(completion) -> dict:
    """A greedy reference (``hf_greedy_generate``'s shape) from one of Tandem's own outputs;
    it must have been generated with ``logprobs >= 2``."""
    logprobs = [
        position[token].logprob
        for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    top2 = [
        tuple(sorted((lp.logprob for lp in position.values()), reverse=True)[:2])
        for position in completion.logprobs
    ]
    return {"token_ids": list(completion.token_ids), "logprobs": logprobs, "top2": top2}


def tie_rule_mismatches(
    outputs, references: list[dict], tolerance: float = 1e-4
) -> tuple[list[str], int]:
    """Compare generated outputs with greedy references.

    Tokens must be equal and each logprob within ``tolerance``; the one allowed difference is
    a numerical tie: at the first position where the two differ, the reference's two best
    logprobs are within ``tolerance``, and the comparison of that output stops there.
    Returns (the problems found, how many outputs stopped at a tie).
    """
    problems: list[str] = []
    ties = 0
    for index, (output, ref) in enumerate(zip(outputs, references, strict=True)):
        completion = output.outputs[0]
        ours, theirs = completion.token_ids, ref["token_ids"]
        for position, (token, ref_token) in enumerate(zip(ours, theirs, strict=False)):
            if token != ref_token:
                best, second = ref["top2"][position]
                if best - second >= tolerance:
                    problems.append(
                        f"prompt {index}: token {position} is {token}, the reference "
                        f"chose {ref_token} with a margin of {best - second:.2e}"
                    )
                ties += 1
                break
            ours_lp = completion.logprobs[position][token].logprob
            if abs(ours_lp - ref["logprobs"][position]) >= tolerance:
                problems.append(
                    f"prompt {index}: logprob at {position} is {ours_lp}, "
                    f"the reference has {ref['logprobs'][position]}"
                )
        else:
            if len(ours) != len(theirs):
                problems.append(
                    f"prompt {index}: {len(ours)} tokens, the reference has {len(theirs)}"
                )
    return problems, ties
