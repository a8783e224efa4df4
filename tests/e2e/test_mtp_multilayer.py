"""A head of two MTP layers (issue 22), fp32 on the CPU. Each layer keeps KV at every
position, layer 1's row at q taking layer 0's output at q - 1 (zeros at 0), so every draft
the engine makes (prompt chunks, then verified steps) equals a dense reference forward of
the same head over the full sequence, written here from the definition: layer 0 over the
target's hidden states, layer 1 over layer 0's shifted outputs, then the draft chain (depth
1 on layer 1, depth 2 repeating it); the steps resolved on the device draft the same.
Greedy outputs equal plain decoding (lossless); the training loss runs the same layout; PD
hands the hidden caches over with the KV."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench.datasets import load_mtbench
from tandem.config import DisaggConfig, EngineConfig, SpeculativeConfig
from tandem.core.engine_core import EngineCore
from tandem.layers.attention import DenseCausalBackend
from tandem.models.loader import ModelFiles, default_model_path, load_model
from tandem.models.mtp import MTPHead, load_mtp_head, random_head
from tandem.models.mtp_files import save_head
from tandem.train.mtp_distill import distill_loss
from tests.unit.mtp_head_helpers import dense_layer

pytestmark = pytest.mark.slow  # three engines and a dense reference per draft step

K = 3
MAX_TOKENS = 16
TIE = 1e-4  # a reference draft whose top two logits are closer is not compared


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> str:
    """The shipped head's trained layer (its first drafts are often accepted), without its
    fused features, grown to two layers as ``train-mtp --num-layers 2`` grows it; fp32."""
    files = ModelFiles(default_model_path())
    base = load_model(files, 512, torch.float32, torch.device("cpu"))
    shipped = load_mtp_head(None, files, base.rotary)
    head = MTPHead(files.arch, 1, base.rotary)
    head.layers[0].load_state_dict(shipped.layers[0].state_dict())
    head.grow(2)
    directory = str(tmp_path_factory.mktemp("two-layer-head"))
    save_head(head, directory, "test", dtype=torch.float32)
    return directory


@pytest.fixture(scope="module")
def prompts(offline_tokenizer) -> list[dict]:
    questions = [q["turns"][0] for q in load_mtbench()[1::20]][:3]
    return [
        {
            "prompt_token_ids": offline_tokenizer.apply_chat_template(
                [{"role": "user", "content": q}]
            )
        }
        for q in questions
    ]


@pytest.fixture(scope="module")
def offline_tokenizer():
    from tandem.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


def _argmax_or_tie(model, layer, g) -> int | None:
    logits = model.compute_logits(layer.final_norm(g.unsqueeze(0)))[0]
    top = logits.topk(2)
    return None if float(top.values[0] - top.values[1]) < TIE else int(top.indices[0])


@torch.inference_mode()
def reference_drafts(model, head, seq: list[int], e: int, drafts: list[int]) -> list[int | None]:
    """The drafts at drafting position ``e`` of ``seq`` (its tokens through e + 1 known),
    each depth on the engine's drafts before it; None where the reference is a near-tie."""
    n = e + 1
    caches = [(None, None)] * len(model.layers)
    device = model.embed_tokens.weight.device  # the engine's (the GPU run's cuda)
    tokens, positions = torch.tensor(seq[:n], device=device), torch.arange(n, device=device)
    target = model(tokens, positions, caches, None, DenseCausalBackend(1, n))
    layer0, layer1 = head.layers
    # Layer 0 at every position q <= e: the target's h[q] and the token at q + 1.
    g0 = dense_layer(layer0, list(range(n)), seq[1 : n + 1], target, model)
    wanted = [_argmax_or_tie(model, layer0, g0[e])]
    # Layer 1 at every q <= e on layer 0's output at q - 1, then the chain: depth 1 at e + 1
    # (layer 0's output at e, draft 1), depth 2 at e + 2 (depth 1's output, draft 2).
    stream = torch.cat([torch.zeros_like(g0[:1]), g0[:-1]])
    rows_hidden, rows_tokens = [stream, g0[e:]], seq[1 : n + 1] + [drafts[0]]
    for depth in range(1, K):
        out = dense_layer(
            layer1, list(range(n + depth)), rows_tokens, torch.cat(rows_hidden), model
        )
        wanted.append(_argmax_or_tie(model, layer1, out[-1]))
        rows_hidden.append(out[-1:])
        rows_tokens = rows_tokens + [drafts[depth]]
    return wanted


def _recorded(llm: LLM, monkeypatch) -> list[tuple[str, int, list[int]]]:
    """(request, drafting position, drafts) of every draft run of ``llm``'s proposer."""
    proposer = llm.engine.runner.proposer
    propose, records = proposer.propose, []

    def recording(rows, target_hidden, sampling, sampled=None):
        proposal = propose(rows, target_hidden, sampling, sampled)
        for row in rows:
            if row.request_id in proposal.draft_token_ids:
                drafts = proposal.draft_token_ids[row.request_id].tolist()
                records.append((row.request_id, row.positions[-1], drafts))
        return proposal

    monkeypatch.setattr(proposer, "propose", recording)
    return records


def test_drafts_equal_the_dense_reference_and_outputs_plain_decoding(
    make_llm, head_dir, prompts, monkeypatch
):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = make_llm(overlap=False).generate(prompts, params, use_tqdm=False)
    llm = make_llm(
        overlap=False, speculative="mtp", num_speculative_tokens=K, speculative_model=head_dir
    )
    assert llm.engine.runner.mtp_head.num_layers == 2
    # Every step on the host-read path, whose drafts are recorded here (the steps resolved
    # on the device: the next test).
    monkeypatch.setattr(llm.engine.pipeline.mtp, "row_resolvable", lambda row, ahead: False)
    records = _recorded(llm, monkeypatch)
    before = llm.get_metrics()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids  # lossless
    after = llm.get_metrics()
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    sequences = {o.request_id: o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs}
    compared = ties = 0
    for request_id, e, drafts in records:
        seq = sequences[request_id]
        if e + 1 >= len(seq):
            continue  # the request ended at e: nothing after it was kept
        wanted = reference_drafts(
            llm.engine.runner.model, llm.engine.runner.mtp_head, seq, e, drafts
        )
        for depth, (got, want) in enumerate(zip(drafts, wanted, strict=True)):
            if want is None:
                ties += 1
                continue
            assert got == want, (request_id, e, depth, drafts, wanted)
            compared += 1
    assert compared >= 3 * len(prompts) * K and ties <= compared // 20


def _per_position(before: dict, after: dict) -> list[float]:
    key = "spec_decode_num_accepted_tokens_per_pos"
    return [a - b for a, b in zip(after[key], before[key], strict=True)]


def test_steps_resolved_on_the_device_draft_as_the_host_read_path(
    make_llm, head_dir, prompts, monkeypatch
):
    """The fixed-shape step (every verified row through both layers, on the device, launched
    ahead) drafts what the host-read path drafts: the same accepted drafts at every depth."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    spec = {"speculative": "mtp", "num_speculative_tokens": K, "speculative_model": head_dir}
    ahead = make_llm(overlap=True, **spec)
    launched, before = ahead.engine.pipeline.num_launched_ahead, ahead.get_metrics()
    resolved = ahead.generate(prompts, params, use_tqdm=False)
    assert ahead.engine.pipeline.num_launched_ahead - launched >= 5
    resolved_accepted = _per_position(before, ahead.get_metrics())
    host = make_llm(overlap=False, **spec)
    monkeypatch.setattr(host.engine.pipeline.mtp, "row_resolvable", lambda row, ahead: False)
    before = host.get_metrics()
    read = host.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in resolved] == [o.outputs[0].token_ids for o in read]
    assert resolved_accepted == _per_position(before, host.get_metrics())
    assert resolved_accepted[1] > 0  # depth 2 (layer 1) accepted drafts


def test_training_runs_the_same_layout():
    files = ModelFiles("dummy:tiny")
    base = load_model(files, 64, torch.float32, torch.device("cpu"))
    head = random_head(files.arch, 2, base.rotary)
    loss, agree = distill_loss(head, base, torch.randint(0, 500, (2, 16)))
    loss.backward()
    assert torch.isfinite(loss) and 0 <= float(agree[0]) <= 1
    assert head.layers[1].eh_proj.weight.grad.abs().sum() > 0  # layer 1 learns


def test_pd_hands_the_hidden_caches_over_with_the_kv(head_dir, prompts, monkeypatch):
    """A prefill and a decode instance with the two-layer head report what a mixed instance
    reports and accept the same drafts; layer 1's row at each prompt's end reads layer 0's
    output at the prompt's last position, on the decode side the one the prefill instance
    wrote and handed over with the KV (``HiddenCache``), equal to the mixed instance's."""
    from pd_steps import assert_no_leak, compare, run, settle, submit

    from tandem.config import CacheConfig
    from tandem.disagg.kv_connector import LocalKVConnector
    from tandem.disagg.setup import start_pd_role
    from tandem.worker.spec_decode.proposer import MTPProposer

    ends = {len(p["prompt_token_ids"]) for p in prompts}
    assert len(ends) == len(prompts)  # a prompt's end names its request
    read_at_end: dict[int, dict[int, torch.Tensor]] = {}  # proposer id -> position -> input
    stream = MTPProposer.stream_later_layers

    def recording(self, first, positions, embeds, slot_ids, previous_slots, metadata):
        stored = self.hidden_caches[0].read(previous_slots.clamp(min=0))  # before this write
        # Rows whose previous position an earlier step wrote (not a prompt's inner rows).
        earlier = (~torch.isin(previous_slots, slot_ids)).tolist()
        for row, position in enumerate(positions.tolist()):
            if position in ends and earlier[row]:
                read_at_end.setdefault(id(self), {}).setdefault(position, stored[row].clone())
        return stream(self, first, positions, embeds, slot_ids, previous_slots, metadata)

    monkeypatch.setattr(MTPProposer, "stream_later_layers", recording)

    def config(role: str) -> EngineConfig:
        return EngineConfig(
            cache=CacheConfig(num_blocks=128),
            speculative=SpeculativeConfig("mtp", K, model=head_dir),
            disagg=DisaggConfig(role=role, secret="test-multilayer-secret"),
        )

    registry: dict = {}
    mixed, prefill, decode = (EngineCore(config(r)) for r in ("mixed", "prefill", "decode"))
    try:
        start_pd_role(prefill, LocalKVConnector(registry, "prefill"))
        start_pd_role(decode, LocalKVConnector(registry, "decode"))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
        ids = [f"two-layer-{i}" for i in range(len(prompts))]
        tokens = [p["prompt_token_ids"] for p in prompts]
        submit(mixed, ids, tokens, [params] * len(ids), None)
        want = run([mixed], mixed, set(ids))
        submit(decode, ids, tokens, [params] * len(ids), prefill.control_address)
        got = run([prefill, decode], decode, set(ids))
        compare(got, want)
        # The decode side verified every draft the mixed instance did, after the handed-over
        # first ones, and accepted as many.
        assert decode.scheduler.spec_num_accepted_tokens == mixed.scheduler.spec_num_accepted_tokens
        mixed_reads = read_at_end[id(mixed.runner.proposer)]
        decode_reads = read_at_end[id(decode.runner.proposer)]
        assert set(decode_reads) == set(mixed_reads) == ends
        for position in ends:
            assert decode_reads[position].abs().sum() > 0
            torch.testing.assert_close(
                decode_reads[position], mixed_reads[position], rtol=1e-4, atol=1e-4
            )
        settle([prefill, decode])
        assert_no_leak(prefill, decode)
    finally:
        for core in (mixed, prefill, decode):
            core.shutdown()


def test_sampled_requests_draft_with_both_layers(make_llm, head_dir, prompts):
    """Rejection sampling over the two-layer head's sampled drafts: seeded requests give the
    same tokens twice, and drafts are accepted (the distribution itself: the chi-square tests
    of ``tests/unit/test_verification.py``)."""
    llm = make_llm(
        overlap=False, speculative="mtp", num_speculative_tokens=K, speculative_model=head_dir
    )
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS)
        for seed in range(len(prompts))
    ]
    before = llm.get_metrics()
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    after = llm.get_metrics()
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
