"""Logprobs in the API's shapes: OpenAI's completions (legacy) and chat forms, echoed
prompts, and vLLM's ``prompt_logprobs``. A position's entries are the engine's (token id ->
Logprob with its rank); ``num_top`` keeps those ranked at most that."""

from __future__ import annotations

from tandem.outputs import PositionLogprobs


def _top(position: PositionLogprobs, num_top: int) -> list:
    """The entries ranked at most ``num_top``, best first."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
    return [(token, lp) for token, lp in ranked if lp.rank <= num_top]


def completion_logprobs(
    tokens: list[int], positions: list[PositionLogprobs], num_top: int, text_offset: int
) -> dict:
    """OpenAI's completions form for generated tokens: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``num_top`` and the chosen token, as OpenAI and vLLM return
    them: up to ``num_top + 1`` entries; null when ``num_top`` is 0) and ``text_offset``
    (from ``text_offset``)."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for token, position in zip(tokens, positions, strict=True):
        chosen = position[token]
        result["tokens"].append(chosen.decoded_token)
        result["token_logprobs"].append(chosen.logprob)
        top = {lp.decoded_token: lp.logprob for _, lp in _top(position, num_top)}
        top.setdefault(chosen.decoded_token, chosen.logprob)
        result["top_logprobs"].append(top if num_top else None)
        result["text_offset"].append(offset)
        offset += len(chosen.decoded_token)
    return result


def echoed_prompt_logprobs(
    prompt_token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    first_token_text: str,
) -> dict:
    """The completions form for an echoed prompt: its first token has no logprob (nothing
    precedes it: ``null`` entries, its text ``first_token_text``), every later one the
    engine's prompt logprob; offsets from 0."""
    first = {"tokens": [first_token_text], "token_logprobs": [None], "top_logprobs": [None]}
    first["text_offset"] = [0]
    rest = completion_logprobs(prompt_token_ids[1:], positions[1:], num_top, len(first_token_text))
    return joined(first, rest)


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions-form logprobs one after the other (either may be None)."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokens: list[int], positions: list[PositionLogprobs], num_top: int) -> dict:
    """OpenAI's chat form: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    content = []
    for token, position in zip(tokens, positions, strict=True):
        chosen = position[token]
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": chosen.logprob,
                "bytes": list(chosen.decoded_token.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token,
                        "logprob": lp.logprob,
                        "bytes": list(lp.decoded_token.encode()),
                    }
                    for _, lp in _top(position, num_top)
                ],
            }
        )
    return {"content": content}


def vllm_prompt_logprobs(
    prompt_token_ids: list[int], positions: list[PositionLogprobs | None], num_top: int
) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id:
    {logprob, rank, decoded_token}}`` holding the prompt's token and the top ``num_top``."""
    result: list[dict | None] = []
    for token, position in zip(prompt_token_ids, positions, strict=True):
        if position is None:
            result.append(None)
            continue
        kept = dict(_top(position, num_top))
        kept[token] = position[token]
        result.append(
            {
                str(token_id): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for token_id, lp in kept.items()
            }
        )
    return result
