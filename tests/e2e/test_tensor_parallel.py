"""Tensor parallelism: two gloo ranks on the CPU, each a whole engine over half of
dummy:tiny's heads, MLP and vocabulary, generate what one process generates (greedy tokens
equal under the tie rule, logprobs within 1e-4), plain and with MTP; both ranks return the
same outputs, so their schedulers stayed in lockstep."""

from __future__ import annotations

import functools
import os
import queue
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tandem import LLM, SamplingParams
from tandem.bench.hf_reference import reference_from_output, tie_rule_mismatches
from tandem.engine_process import free_port

pytestmark = pytest.mark.slow  # tensor-parallel ranks in spawned processes

WORLD_SIZE = 2
TOLERANCE = 1e-4
TIMEOUT_S = 150  # for the whole spawned run; a failing rank ends it at once
COMMON = {"model": "dummy:tiny", "dtype": "float32", "num_kv_blocks": 64}
ENGINES = {
    "plain": {},
    "mtp": {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_model": "dummy"},
}


def _prompts() -> list[dict]:
    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 512, (8, 16), generator=generator)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)


def _join_group(rank: int, port: int, device: str) -> None:
    from tandem.models.tensor_parallel import init_process_group

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_process_group(device)


def _rank_main(rank: int, port: int, results: mp.Queue, task, device: str) -> None:
    """One rank: join the group, run ``task(rank)`` and put (rank, result or traceback)."""
    import torch.distributed as dist

    try:
        _join_group(rank, port, device)
        results.put((rank, task(rank)))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(task, device: str = "cpu") -> dict:
    """``task(rank)`` on WORLD_SIZE spawned ranks: their results by rank. Every process is
    joined or killed on return, so a failing or hanging rank cannot hang the test run."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, port, results, task, device))
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    try:
        by_rank = {}
        for _ in processes:
            try:
                rank, result = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"tensor-parallel ranks gave no result in {TIMEOUT_S} s")
            if isinstance(result, BaseException):
                pytest.fail(f"rank {rank} failed:\n{result}")
            by_rank[rank] = result
        for process in processes:
            process.join(timeout=30)
        return by_rank
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


def _generate_per_engine(
    tokenizer: str, rank: int, device: str = "cpu", engines: dict | None = None
) -> dict:
    """Each engine of ``engines`` (default ENGINES) at tensor_parallel_size 2: its outputs
    and drafts verified."""
    outputs = {}
    if device == "cuda":
        device = f"cuda:{rank}"
    for name, options in (engines or ENGINES).items():
        llm = LLM(
            tokenizer=tokenizer, tensor_parallel_size=WORLD_SIZE, device=device, **COMMON, **options
        )
        generated = llm.generate(_prompts(), _greedy(), use_tqdm=False)
        outputs[name] = (generated, llm.get_metrics()["spec_decode_num_drafts"])
        llm.engine.shutdown()
    return outputs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, llm_cache) -> str:
    """The tokenizer that dummy:tiny borrows, saved as a Hugging Face directory: the ranks
    load it in well under the seconds that converting the GGUF one takes."""
    key = tuple(sorted(COMMON.items()))  # make_llm's key: the tests reuse this engine
    if key not in llm_cache:
        llm_cache[key] = LLM(**COMMON)
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    llm_cache[key].tokenizer.hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def feature_head_dir(tmp_path_factory) -> str:
    """A random one-layer head for dummy:tiny that drafts from fused features of both its
    layers (the projection replicated on every rank, the residual stream whole there)."""
    from tandem.models.loader import ModelFiles, load_model
    from tandem.models.mtp_files import save_head
    from tests.unit.mtp_head_helpers import head_with_features, random_head

    files = ModelFiles(COMMON["model"])
    base = load_model(files, 64, torch.float32, torch.device("cpu"))
    head = head_with_features(base, random_head(files.arch, 1, seed=3), (0, 1), low_scale=0.05)
    directory = str(tmp_path_factory.mktemp("feature-head"))
    save_head(head, directory, COMMON["model"], dtype=torch.float32)
    return directory


@pytest.fixture(scope="module")
def engines(feature_head_dir) -> dict:
    features = {**ENGINES["mtp"], "speculative_model": feature_head_dir}
    return {**ENGINES, "mtp-features": features}


@pytest.fixture(scope="module")
def tp_outputs(tokenizer_dir, engines) -> dict:
    return _run_ranks(functools.partial(_generate_per_engine, tokenizer_dir, engines=engines))


def _summary(outputs) -> list:
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


def test_ranks_return_the_same_outputs(tp_outputs, engines):
    for name in engines:
        assert _summary(tp_outputs[0][name][0]) == _summary(tp_outputs[1][name][0]), name


@pytest.mark.parametrize("name", [*ENGINES, "mtp-features"])
def test_tensor_parallel_greedy_matches_one_process(make_llm, tp_outputs, engines, name):
    baseline = make_llm(**COMMON, **engines[name]).generate(_prompts(), _greedy())
    outputs, num_drafts = tp_outputs[0][name]
    references = [reference_from_output(o.outputs[0]) for o in baseline]
    problems, _ = tie_rule_mismatches(outputs, references, TOLERANCE)
    assert not problems, problems
    if name != "plain":
        assert num_drafts > 0, "no drafts were verified"


def test_first_token_logprobs_match_one_process(make_llm, tp_outputs):
    baseline = make_llm(**COMMON).generate(_prompts(), _greedy())
    for output, expected in zip(tp_outputs[0]["plain"][0], baseline, strict=True):
        got, want = output.outputs[0].logprobs[0], expected.outputs[0].logprobs[0]
        assert got.keys() == want.keys()
        for token, entry in want.items():
            assert abs(got[token].logprob - entry.logprob) < TOLERANCE


def _vocab_parallel_errors(rank: int) -> tuple[float, float]:
    """A tied model with a 511-token vocabulary over two ranks (one padding row): its
    sharded embedding and logits against the whole model's, as max absolute differences."""
    from dataclasses import replace

    from tandem.models.llama import LlamaModel
    from tandem.models.registry import dummy_preset
    from tandem.models.tensor_parallel import shard_model

    torch.manual_seed(0)
    model = LlamaModel(
        replace(dummy_preset("tiny"), vocab_size=511, tie_word_embeddings=True), 64
    ).requires_grad_(False)
    token_ids = torch.tensor([0, 1, 255, 256, 257, 509, 510])
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        expected_embeds = model.embed_tokens(token_ids)
        expected_logits = model.compute_logits(hidden)
        shard_model(model, rank, WORLD_SIZE)
        embeds, logits = model.embed_tokens(token_ids), model.compute_logits(hidden)
    assert logits.shape == (3, 511)
    return (
        float((embeds - expected_embeds).abs().max()),
        float((logits - expected_logits).abs().max()),
    )


def test_vocab_parallel_layers_pad_and_gather_exactly():
    for embed_error, logits_error in _run_ranks(_vocab_parallel_errors).values():
        assert embed_error == 0.0
        assert logits_error < 1e-5  # the shards' matmuls may round differently


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason="needs two GPUs")
def test_tensor_parallel_on_two_gpus_matches_one(tokenizer_dir):
    """NCCL between two GPUs, CUDA graphs on (their all-reduces captured): fp32 greedy
    equal to one GPU's engine under the tie rule, plain and with MTP."""
    by_rank = _run_ranks(
        functools.partial(_generate_per_engine, tokenizer_dir, device="cuda"), device="cuda"
    )
    for name, options in ENGINES.items():
        one_gpu = LLM(tokenizer=tokenizer_dir, device="cuda", **COMMON, **options)
        baseline = one_gpu.generate(_prompts(), _greedy(), use_tqdm=False)
        one_gpu.engine.shutdown()
        references = [reference_from_output(o.outputs[0]) for o in baseline]
        for rank in range(WORLD_SIZE):
            problems, _ = tie_rule_mismatches(by_rank[rank][name][0], references, TOLERANCE)
            assert not problems, (name, rank, problems)
