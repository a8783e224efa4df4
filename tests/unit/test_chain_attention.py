"""Training's repeated draft depths attend as the engine's draft chain does (issue 22).

The reference is written from the serving definition, one chain at a time: for a chain from
position P, the head's last layer runs causally over its stream rows at positions
0 .. P + L - 1 followed by the chain's rows for depths L .. d (each on the previous depth's
output and the next token); depth d's draft is the last row. Training computes every chain
at once (``depth_outputs``); its depth-d row P must equal that last row, for heads of one and
two layers. The older training (causal attention over a depth's own rows) does not.
"""

from __future__ import annotations

import pytest
import torch
from mtp_head_helpers import dense_layer

from tandem.models.loader import ModelFiles, load_model
from tandem.models.mtp import random_head
from tandem.train.mtp_distill import _base_outputs, depth_outputs, distill_loss

SEQ_LEN = 10


def _reference_chain(model, head, seq: list[int], hidden, depth: int, start: int):
    """Depth ``depth``'s output for the chain from position ``start`` (P), from the
    definition: own layers at every position, then the last layer's stream plus chain."""
    n = SEQ_LEN - 1
    own = [dense_layer(head.layers[0], list(range(n)), seq[1:], hidden[:n], model)]
    for index in range(1, head.num_layers):
        shifted = torch.cat([torch.zeros_like(own[-1][:1]), own[-1][:-1]])
        own.append(dense_layer(head.layers[index], list(range(n)), seq[1:], shifted, model))
    last = head.num_layers - 1
    stream_inputs = hidden[:n] if last == 0 else torch.cat([own[-2][:1] * 0, own[-2][:-1]])
    end = start + last  # the stream's last position
    rows_hidden = [stream_inputs[: end + 1]]
    rows_tokens = seq[1 : end + 2]
    previous = own[-1][end : end + 1]
    for j in range(head.num_layers, depth + 1):
        rows_hidden.append(previous)
        rows_tokens = rows_tokens + [seq[start + j + 1]]
        out = dense_layer(
            head.layers[last],
            list(range(start + j + 1)),
            rows_tokens,
            torch.cat(rows_hidden),
            model,
        )
        # Positions: the stream's 0 .. end, then the chain's start + L .. start + j.
        previous = out[-1:]
    return previous[0]


@pytest.mark.parametrize("num_layers", [1, 2])
@torch.inference_mode()
def test_repeated_depths_attend_as_the_serving_chain(num_layers):
    files = ModelFiles("dummy:tiny")
    model = load_model(files, 64, torch.float32, torch.device("cpu"))
    head = random_head(files.arch, num_layers, model.rotary, seed=1)
    tokens = torch.randint(0, 500, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    hidden, _, _ = _base_outputs(model, tokens)
    depths = num_layers + 2
    chained = list(depth_outputs(head, model, tokens, hidden, depths, chain=True))
    older = list(depth_outputs(head, model, tokens, hidden, depths, chain=False))
    assert [d for d, *_ in chained] == list(range(depths))
    for (depth, start, _, g), (_, _, _, g_older) in zip(chained, older, strict=True):
        if depth < num_layers:
            torch.testing.assert_close(g, g_older)  # own layers: plain causal either way
            continue
        assert start == depth
        for b in range(tokens.shape[0]):
            seq = tokens[b].tolist()
            for chain_start in range(SEQ_LEN - 1 - depth):
                want = _reference_chain(model, head, seq, hidden[b], depth, chain_start)
                torch.testing.assert_close(g[b, chain_start], want, atol=1e-5, rtol=1e-5)
        # The older mask sees other rows than the chain does (beyond the first chain).
        assert not torch.allclose(g[:, 1:], g_older[:, 1:], atol=1e-3)


def test_the_loss_trains_every_depth_under_the_chain_mask():
    files = ModelFiles("dummy:tiny")
    model = load_model(files, 64, torch.float32, torch.device("cpu"))
    head = random_head(files.arch, 1, model.rotary)
    loss, agreements = distill_loss(head, model, torch.randint(0, 500, (2, 16)), chain=True)
    loss.backward()
    assert torch.isfinite(loss) and len(agreements) == 3
    assert all(0 <= float(a) <= 1 for a in agreements)
    assert head.layers[0].block.self_attn.qkv_proj.weight.grad.abs().sum() > 0


def test_a_cold_teacher_makes_the_loss_the_cross_entropy_of_the_base_s_first_choice():
    """At teacher temperature T the base's log-probs are divided by T and normalized again;
    as T nears 0 the KL nears each depth's cross-entropy against the base's argmax."""
    from tandem.train.mtp_distill import DEPTH_WEIGHTS

    files = ModelFiles("dummy:tiny")
    model = load_model(files, 64, torch.float32, torch.device("cpu"))
    head = random_head(files.arch, 1, model.rotary)
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, _ = distill_loss(head, model, tokens)
        assert torch.equal(distill_loss(head, model, tokens, teacher_temperature=1.0)[0], plain)
        cold, _ = distill_loss(head, model, tokens, teacher_temperature=1e-4)
        hidden, base_logprobs, _ = _base_outputs(model, tokens)
        want = 0.0
        for depth, start, layer, g in depth_outputs(head, model, tokens, hidden, 3):
            student = model.compute_logits(layer.final_norm(g)).log_softmax(dim=-1)
            first = base_logprobs[:, start + 1 :].argmax(-1, keepdim=True)
            want += DEPTH_WEIGHTS[depth] * -student.gather(-1, first).mean()
    torch.testing.assert_close(cold, torch.as_tensor(want), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(cold, plain, atol=1e-2)
    with pytest.raises(ValueError, match="teacher_temperature"):
        distill_loss(head, model, tokens, teacher_temperature=0.0)


def test_train_mtp_gives_a_head_fused_features_and_keeps_them(tmp_path):
    """``--feature-layers``: the saved head records them and trains its projection (the low
    layer's block leaves zero); a continued head keeps them; a list that does not end with
    the base's last layer is refused."""
    from tandem.models.loader import ModelFiles, load_model
    from tandem.models.mtp import load_mtp_head
    from tandem.models.mtp_files import head_feature_layers
    from tandem.train.mtp_distill import TrainConfig, train_mtp

    tokens = torch.randint(0, 500, (8, 16), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(steps=3, batch_size=2, seq_len=16, eval_every=3, feature_layers=(0, 1))
    first = str(tmp_path / "first")
    head, _ = train_mtp("dummy:tiny", tokens, tokens[:2], config, out_dir=first, progress=False)
    assert head_feature_layers(first) == (0, 1)
    hidden = head.arch.hidden_size
    assert head.feature_proj.weight[:, :hidden].abs().sum() > 0  # trained from zero
    files = ModelFiles("dummy:tiny")
    loaded = load_mtp_head(first, files, load_model(files, 32, torch.float32, "cpu").rotary)
    saved = head.feature_proj.weight.detach().to(torch.bfloat16).float()  # kept in bf16
    assert torch.equal(loaded.feature_proj.weight, saved)
    then = TrainConfig(steps=1, batch_size=2, seq_len=16, eval_every=1, init_head=first)
    continued, _ = train_mtp("dummy:tiny", tokens, tokens[:2], then, progress=False)
    assert continued.feature_layers == (0, 1)
    wrong = TrainConfig(steps=1, batch_size=2, seq_len=16, feature_layers=(0,))
    with pytest.raises(ValueError, match="last layer"):
        train_mtp("dummy:tiny", tokens, tokens[:2], wrong, progress=False)


def test_train_mtp_grows_a_continued_head_to_more_layers(tmp_path):
    """``--num-layers`` above a continued head's: the new layer starts as a copy of its last
    (own parameters, not shared) and trains apart from it; the saved head has both layers
    and its fused features; a head of more layers keeps them (no shrinking)."""
    from tandem.models.loader import ModelFiles, load_model
    from tandem.models.mtp import load_mtp_head
    from tandem.models.mtp_files import read_head_file
    from tandem.train.mtp_distill import TrainConfig, train_mtp

    tokens = torch.randint(0, 500, (8, 16), generator=torch.Generator().manual_seed(2))
    config = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, feature_layers=(0, 1))
    first = str(tmp_path / "first")
    one, _ = train_mtp("dummy:tiny", tokens, tokens[:2], config, out_dir=first, progress=False)
    files = ModelFiles("dummy:tiny")
    copied = load_mtp_head(first, files, load_model(files, 32, torch.float32, "cpu").rotary)
    copied.grow(2)
    assert copied.num_layers == 2 and copied.feature_layers == (0, 1)
    new, old = copied.layers[1].state_dict(), copied.layers[0].state_dict()
    assert all(torch.equal(new[name], old[name]) for name in old)
    assert copied.layers[1].eh_proj.weight is not copied.layers[0].eh_proj.weight
    trained = TrainConfig(
        steps=3, batch_size=2, seq_len=16, eval_every=3, init_head=first, num_layers=2
    )
    second = str(tmp_path / "second")
    two, _ = train_mtp("dummy:tiny", tokens, tokens[:2], trained, out_dir=second, progress=False)
    assert not torch.equal(two.layers[1].eh_proj.weight, two.layers[0].eh_proj.weight)
    assert read_head_file(second)[0] == 2
    kept = TrainConfig(steps=1, batch_size=2, seq_len=16, eval_every=1, init_head=second)
    assert train_mtp("dummy:tiny", tokens, tokens[:2], kept, progress=False)[0].num_layers == 2
    with pytest.raises(ValueError, match="cannot grow"):
        two.grow(1)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        train_mtp("dummy:tiny", tokens, tokens[:2], TrainConfig(steps=0), progress=False)
