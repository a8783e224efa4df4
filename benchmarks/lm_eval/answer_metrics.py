"""The generate_until task's metric (gen_short_qa.yaml): whether the generation contains the
short answer, case-insensitively. A side number; what scripts/lm_eval_check.py checks is that
the generations are the same string by string across backends."""


def contains_answer(doc: dict, results: list[str]) -> dict[str, float]:
    return {"contains_answer": float(doc["answer"].lower() in results[0].lower())}
