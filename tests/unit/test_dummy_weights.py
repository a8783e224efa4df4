"""Dummy weights: ``dummy:NAME-peaked`` keeps NAME's architecture and makes each greedy
choice a function of the input token with a wide margin (the oracle benchmark's target)."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.attention import DenseCausalBackend
from tandem.models.loader import ModelFiles, load_model
from tandem.models.registry import dummy_preset


def test_peaked_name_keeps_the_architecture():
    assert dummy_preset("tiny-peaked") == dummy_preset("tiny")
    assert dummy_preset("llama3-8b-peaked").vocab_size == 128256
    with pytest.raises(ValueError, match="nope-peaked"):
        dummy_preset("nope-peaked")


def _greedy_choices(model: str, steps: int = 24):
    """Greedy-decode one sequence in fp32 without a KV cache (the full prefix each step); per step:
    (chosen token, the token the last input alone would choose)."""
    files = ModelFiles(model)
    net = load_model(files, 1024, torch.float32, torch.device("cpu"), seed=0)
    caches = [(None, None)] * len(net.layers)
    tokens = [5, 77, 300, 12]
    rows = []
    for _ in range(steps):
        ids = torch.tensor(tokens)
        backend = DenseCausalBackend(1, len(tokens))
        hidden = net(ids, torch.arange(len(tokens)), caches, None, backend)
        logits = net.compute_logits(hidden[-1:])[0]
        alone = net.compute_logits(net.norm(net.embed_tokens(ids[-1:])))[0]
        chosen = int(logits.argmax())
        rows.append((chosen, int(alone.argmax())))
        tokens.append(chosen)
    return rows


def test_peaked_choices_follow_the_last_token_with_a_wide_margin():
    rows = _greedy_choices("dummy:tiny-peaked")
    # The context barely moves the last hidden state: the choice is the last token's, so
    # rounding that differs with the batch shape cannot turn it.
    assert all(chosen == alone for chosen, alone in rows)
    assert len({chosen for chosen, _ in rows}) > 1


def test_plain_dummy_choices_depend_on_the_whole_context():
    rows = _greedy_choices("dummy:tiny")
    assert any(chosen != alone for chosen, alone in rows)
