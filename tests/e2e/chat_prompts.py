"""MT-Bench first turns in the default model's chat template: the prompts of several e2e
tests' engines (the default engine, shared through ``llm_cache``, lends its tokenizer)."""

from __future__ import annotations

from tandem.bench.datasets import load_mtbench


def mtbench_chat_prompts(llm_cache, start: int, step: int, count: int) -> list[dict]:
    """MT-Bench questions ``start``, ``start + step``, ... (``count`` of them), each first
    turn as ``{"prompt_token_ids": ...}`` in the default model's chat template."""
    from tandem import LLM

    if () not in llm_cache:
        llm_cache[()] = LLM()
    template = llm_cache[()].tokenizer.apply_chat_template
    questions = [q["turns"][0] for q in load_mtbench()[start::step]][:count]
    return [{"prompt_token_ids": template([{"role": "user", "content": q}])} for q in questions]
