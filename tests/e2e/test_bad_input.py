"""Bad input raises a ValueError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_others_keep_running(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.generate("Hello there", params)[0].outputs[0].token_ids
    # A request in flight while bad ones arrive.
    running = llm.add_request("Hello there", params)
    too_long = {"prompt_token_ids": [42] * (llm.engine.max_model_len + 1)}
    for bad, message in [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        (too_long, "context"),
        ({"prompt_token_ids": [10**9]}, "outside"),
        (12345, "prompt"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.add_request(bad, params)
    done = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output
    assert done[running].outputs[0].token_ids == expected


def test_a_bad_prompt_in_a_batch_rejects_the_batch_before_running_any(llm):
    before = llm.get_metrics()["num_requests_added"]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4))
    assert llm.get_metrics()["num_requests_added"] == before


def test_mismatched_params_list_is_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_unknown_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(model=missing)


def test_corrupt_gguf_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(model=str(path))


def test_abort_frees_blocks_mid_generation(llm):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    request_id = llm.add_request("Tell me a long story", params)
    for _ in range(3):
        llm.step()
    assert llm.engine.block_manager.usage > 0
    llm.abort_request(request_id)
    llm.step()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.all_blocks_free()
