"""The token data ``tandem train-mtp`` trains on: chat-templated ShareGPT conversations from
the records before the benchmarks' held-out ones, and replies the base model writes itself."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tandem.bench.datasets import SHAREGPT_HELD_OUT_FROM, iter_sharegpt


def pack_sequences(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate token sequences and cut them into [N, seq_len] rows (the tail is dropped)."""
    flat = [t for s in sequences for t in s]
    rows = len(flat) // seq_len
    if rows == 0:
        raise ValueError(f"only {len(flat)} tokens of data, fewer than one row of {seq_len}")
    return torch.tensor(flat[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def sharegpt_messages(record: dict) -> list[dict[str, str]]:
    """A ShareGPT record's human/gpt turns as chat messages (other and empty turns dropped)."""
    roles = {"human": "user", "gpt": "assistant"}
    turns = [(roles.get(t.get("from")), t.get("value")) for t in record.get("conversations") or []]
    return [{"role": r, "content": v} for r, v in turns if r and isinstance(v, str) and v]


def training_records(before_record: int = SHAREGPT_HELD_OUT_FROM) -> Iterator[dict]:
    """The ShareGPT records before ``before_record`` (those from it on are held out)."""
    for index, record in enumerate(iter_sharegpt()):
        if index >= before_record:
            return
        yield record


def later_turn_prompts(
    tokenizer, records: Iterable[dict], num_prompts: int, max_prompt_tokens: int
) -> list[list[int]]:
    """Prompts for the base's replies to users' later turns: for each user turn that follows
    an assistant reply, the conversation up to it (ending with the assistant header), from
    the earliest user turn that keeps it within ``max_prompt_tokens``; turns that do not fit
    with their previous reply are skipped. At most ``num_prompts``, in the records' order."""
    prompts: list[list[int]] = []
    for record in records:
        messages = sharegpt_messages(record)
        for end, message in enumerate(messages):
            if len(prompts) >= num_prompts:
                return prompts
            if message["role"] != "user" or end < 2 or messages[end - 1]["role"] != "assistant":
                continue
            best = None
            for start in range(end - 2, -1, -1):  # more context as start moves back
                if messages[start]["role"] != "user":
                    continue
                ids = tokenizer.apply_chat_template(messages[start : end + 1])
                if len(ids) > max_prompt_tokens:
                    break
                best = ids
            if best is not None:
                prompts.append(best)
    return prompts


def sharegpt_sequences(
    tokenizer, num_conversations: int, max_tokens: int, before_record: int = SHAREGPT_HELD_OUT_FROM
) -> list[list[int]]:
    """Chat-templated ShareGPT conversations (human/gpt turns), at most max_tokens each, from
    the records before ``before_record`` (those from it on are the benchmarks' held-out set)."""
    sequences = []
    for record in training_records(before_record):
        messages = sharegpt_messages(record)
        if len(messages) < 2:
            continue
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        sequences.append(ids[:max_tokens])
        if len(sequences) >= num_conversations:
            break
    return sequences


def self_generated_sequences(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prompt + the base model's own greedy response, for each prompt."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]


def build_data(
    model: str | None,
    num_conversations: int,
    num_self_generated: int,
    seq_len: int,
    device: str,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Packed train/eval token rows: ShareGPT conversations plus self-generated replies."""
    from tandem.models.loader import resolve_model
    from tandem.tokenizer import Tokenizer

    path = resolve_model(model)
    tokenizer = Tokenizer.from_model_path(
        resolve_model(None) if path.startswith("dummy:") else path
    )
    sequences = sharegpt_sequences(tokenizer, num_conversations + num_self_generated, seq_len)
    if num_self_generated:
        from tandem import LLM

        llm = LLM(model=model, device=device, max_num_seqs=64)
        prompts = []
        for ids in sequences[num_conversations:]:
            # The conversation's first user turn, ending with the assistant prompt.
            end = first_assistant_start(tokenizer, ids)
            prompts.append(ids[:end] if end else ids[: seq_len // 2])
        sequences = sequences[:num_conversations] + self_generated_sequences(
            llm, prompts, max_tokens=seq_len // 2
        )
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed))
    sequences = [sequences[i] for i in order.tolist()]
    held_out = max(1, len(sequences) // 20)
    return {
        "train": pack_sequences(sequences[held_out:], seq_len),
        "eval": pack_sequences(sequences[:held_out], seq_len),
    }


def first_assistant_start(tokenizer, ids: list[int]) -> int | None:
    """Index just after the first '<|im_start|>assistant\\n' style header, if any."""
    header = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    marker = header[-3:]  # the generation prompt's last tokens
    for i in range(len(ids) - len(marker)):
        if ids[i : i + len(marker)] == marker:
            return i + len(marker)
    return None
