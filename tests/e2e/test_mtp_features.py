"""An MTP head that drafts from fused base features (EAGLE-3's low, middle and high layers;
``MTPHead.feature_layers``), fp32 on the CPU, the default model and its shipped head's layer
(as a head without features; the shipped head has them).

A projection added by ``add_feature_projection`` starts as the head it was (training loss and
agreements equal); the engine computes the features in the target's forward and drafts from
them: with that starting projection it accepts exactly what the head without features
accepts, with the low and middle layers' blocks made random it accepts something else, and
greedy outputs stay plain decoding's either way (lossless)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.loader import ModelFiles, default_model_path, load_model
from tandem.models.mtp import load_mtp_head
from tandem.models.mtp_files import head_feature_layers, save_head
from tandem.train.mtp_distill import distill_loss
from tests.unit.mtp_head_helpers import head_with_features, without_features

pytestmark = pytest.mark.slow  # four engines on the default model

FEATURES = (1, 15, 29)  # SmolLM2-135M has 30 layers
PROMPTS = [
    {"prompt_token_ids": [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198]},
    {"prompt_token_ids": [1, 4093, 314, 260, 3575, 282, 4649, 30, 2, 198, 1]},
]


@pytest.fixture(scope="module")
def base_and_head():
    """The base model and the shipped head's layer as a head without fused features."""
    files = ModelFiles(default_model_path())
    base = load_model(files, 512, torch.float32, torch.device("cpu"))
    return files, base, without_features(load_mtp_head(None, files, base.rotary), base.rotary)


def _with_features(base, head, randomize_low: bool):
    return head_with_features(base, head, FEATURES, 0.05 if randomize_low else 0.0)


@torch.inference_mode()
def test_a_feature_projection_starts_as_the_head_it_was(base_and_head):
    _, base, head = base_and_head
    tokens = torch.tensor([PROMPTS[0]["prompt_token_ids"] + [28, 253, 1400, 42, 7, 19]])
    loss, agreements = distill_loss(head, base, tokens)
    fused_loss, fused_agreements = distill_loss(_with_features(base, head, False), base, tokens)
    assert abs(float(fused_loss) - float(loss)) <= 1e-4 * abs(float(loss))
    assert [float(a) for a in fused_agreements] == [float(a) for a in agreements]
    random_loss, _ = distill_loss(_with_features(base, head, True), base, tokens)
    assert abs(float(random_loss) - float(loss)) > 1e-3 * abs(float(loss))


def _run(**options) -> tuple[list[list[int]], int, int]:
    llm = LLM(model=default_model_path(), dtype="float32", kv_cache_memory_gb=0.05, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    metrics = llm.get_metrics()
    llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return (
        tokens,
        metrics.get("spec_decode_num_accepted_tokens", 0),
        metrics.get("spec_decode_num_drafts", 0),
    )


def test_the_engine_drafts_from_the_fused_features(base_and_head, tmp_path):
    files, base, head = base_and_head
    directories = {"none": str(tmp_path / "none")}
    save_head(head, directories["none"], files.path, dtype=torch.float32)
    for name, randomize_low in (("same", False), ("random", True)):
        directories[name] = str(tmp_path / name)
        fused = _with_features(base, head, randomize_low)
        save_head(fused, directories[name], files.path, dtype=torch.float32)
    assert head_feature_layers(directories["same"]) == FEATURES
    assert head_feature_layers(directories["none"]) == ()
    plain, _, _ = _run()
    mtp = {"speculative": "mtp", "num_speculative_tokens": 3}
    shipped = _run(**mtp, speculative_model=directories["none"])
    same = _run(**mtp, speculative_model=directories["same"])
    random = _run(**mtp, speculative_model=directories["random"])
    for tokens, _, drafts in (shipped, same, random):
        assert tokens == plain  # lossless whatever the drafts
        assert drafts > 0
    assert same[1:] == shipped[1:]  # the same drafts: the features are the final state
    assert random[1] != shipped[1]  # the low and middle layers now steer the drafts


def test_a_feature_head_names_bad_feature_layers(base_and_head, tmp_path):
    files, base, head = base_and_head
    directory = str(tmp_path / "bad")
    fused = _with_features(base, head, False)
    fused.feature_layers = (1, 15, 30)  # past SmolLM2's 30 layers
    save_head(fused, directory, files.path, dtype=torch.float32)
    with pytest.raises(ValueError, match="feature layers"):
        load_mtp_head(directory, files, base.rotary)
