"""On the lent GPU: self-generated replies, MTP head distillation within a time budget, then
the head's acceptance on the 80 MT-Bench questions (k=3, greedy, all in one batch).

Usage: gpu_mtp.py MODEL.gguf DATA.pt OUT_DIR TIME_BUDGET_S [gen|train|accept|speed|all]
The self-generated sequences are saved to OUT_DIR/self_generated.pt (`gen` stops there;
SHARD=i/n writes the i-th of n interleaved shards to self_generated_i.pt, one per GPU);
GENERATED=FILE[,FILE...] skips the generation in a later call; INIT_HEAD=DIR continues
training that head; SELF_REPEAT=N repeats the self-generated replies N times in the training
set (they are closest to what the head drafts for when serving); SHAREGPT=0 trains on the
self-generated replies alone; NUM_LAYERS=N trains a new head of N layers; CHAIN=0 trains
repeated depths with the older causal mask; TEACHER_T=T distills from the base's distribution
at temperature T; FEATURES=1:15:29 gives the head fused features of those base layers
(ending with the last; a continued head starts as it was); SELF=0 trains on ShareGPT alone
(no generation); GEN_TEMPERATURE=T writes the replies sampled at temperature T (top-p 0.95,
request i seeded with i + GEN_SEED_OFFSET, default 0: another offset, another set of replies)
instead of greedily; TRAIN_SEED=N seeds the rows training draws (default 0: a call
continuing a head needs another, or it draws the rows the call before drew); HEAD_NAME names
the head's directory under OUT_DIR (default `head`). `speed` is `tandem bench spec`'s run at
batch 1 and 16 (with the non-speculative baseline)."""

import json
import os
import sys
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench.spec import acceptance, first_turns, run_spec_bench
from tandem.train.mtp_data import pack_sequences
from tandem.train.mtp_distill import TrainConfig, train_mtp

model, data_path, out_dir, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
stage = sys.argv[5] if len(sys.argv) > 5 else "all"
# SMOKE=1 runs the same path on the CPU at toy sizes, to catch mistakes before GPU time.
smoke = os.environ.get("SMOKE") == "1"
device, dtype_name = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
head_dir = os.path.join(out_dir, os.environ.get("HEAD_NAME", "head"))
report: dict = {
    "device": "cpu" if smoke else torch.cuda.get_device_name(),
    "torch": torch.__version__,
}
started = time.perf_counter()


def sync() -> None:
    if not smoke:
        torch.cuda.synchronize()


if stage in ("all", "gen", "train"):
    data = torch.load(data_path)
    if smoke:
        data = {"sequences": data["sequences"][:200], "self_prompts": data["self_prompts"][:4]}
    generated = None
    if os.environ.get("SELF") == "0":  # ShareGPT alone: no replies of the base's own
        generated = []
    elif os.environ.get("GENERATED"):
        generated = []
        for path in os.environ["GENERATED"].split(","):
            generated += torch.load(path)["generated"]
    shard, shards = (int(n) for n in os.environ.get("SHARD", "0/1").split("/"))
    if generated is None:
        llm = LLM(
            model=model,
            device=device,
            max_num_seqs=8 if smoke else 384,
            kv_cache_memory_gb=1 if smoke else 24,
        )
        shard_prompts = data["self_prompts"][shard::shards]
        temperature = float(os.environ.get("GEN_TEMPERATURE", "0"))
        seed_offset = int(os.environ.get("GEN_SEED_OFFSET", "0"))
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in shard_prompts],
            [
                SamplingParams(
                    temperature=temperature,
                    top_p=0.95 if temperature else 1.0,
                    # The prompt's index in DATA.pt, plus the offset of this set of replies.
                    seed=shard + shards * i + seed_offset,
                    max_tokens=8 if smoke else 256,
                )
                for i in range(len(shard_prompts))
            ],
            use_tqdm=False,
        )
        sync()
        generated = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
        report["self_generation"] = {
            "requests": len(generated),
            "seconds": time.perf_counter() - started,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "temperature": temperature,
            "seed_offset": seed_offset,
        }
        del llm
        name = f"self_generated_{shard}.pt" if "SHARD" in os.environ else "self_generated.pt"
        torch.save({"generated": generated}, os.path.join(out_dir, name))
        print(json.dumps(report["self_generation"]), flush=True)

if stage in ("all", "train"):
    repeat = int(os.environ.get("SELF_REPEAT", "1"))
    sharegpt = data["sequences"] if os.environ.get("SHAREGPT", "1") == "1" else []
    sequences = sharegpt + generated
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = [sequences[i] for i in order]
    held_out = len(sequences) // 20
    # Repeats are added after the held-out split, so no held-out sequence is trained on.
    extra = [sequences[j] for j in range(held_out, len(sequences)) if order[j] >= len(sharegpt)] * (
        repeat - 1
    )
    train, held = (
        pack_sequences(sequences[held_out:] + extra, 256),
        pack_sequences(sequences[:held_out], 256),
    )
    report["data"] = {
        "train_rows": train.shape[0],
        "eval_rows": held.shape[0],
        "seq_len": 256,
        "sharegpt_sequences": len(sharegpt),
        "self_generated_sequences": len(generated),
        "sharegpt_tokens": sum(map(len, sharegpt)),
        "self_generated_tokens": sum(map(len, generated)),
        "num_layers": int(os.environ.get("NUM_LAYERS", "1")),
        "chain_attention": os.environ.get("CHAIN", "1") == "1",
        "self_repeat": repeat,
        "init_head": os.environ.get("INIT_HEAD"),
        "teacher_temperature": float(os.environ.get("TEACHER_T", "1")),
        "feature_layers": os.environ.get("FEATURES", ""),
    }
    # Leave about a minute of the call for the acceptance run.
    remaining = budget - (time.perf_counter() - started) - (5 if smoke else 75)
    config = TrainConfig(
        steps=20 if smoke else 100_000,
        batch_size=2 if smoke else 32,
        seq_len=256,
        lr=float(os.environ.get("LR", "1e-3")),
        eval_every=500,
        time_budget_s=remaining,
        init_head=os.environ.get("INIT_HEAD"),
        num_layers=int(os.environ.get("NUM_LAYERS", "1")),
        chain_attention=os.environ.get("CHAIN", "1") == "1",
        teacher_temperature=float(os.environ.get("TEACHER_T", "1")),
        feature_layers=tuple(int(i) for i in os.environ.get("FEATURES", "").split(":") if i),
        # Another seed draws other training rows: a call continuing from INIT_HEAD needs one.
        seed=int(os.environ.get("TRAIN_SEED", "0")),
    )
    start = time.perf_counter()
    _, summary = train_mtp(
        model, train, held, config, device, getattr(torch, dtype_name), head_dir, progress=False
    )
    report["training"] = {
        "seconds": time.perf_counter() - start,
        "steps": summary["steps_run"],
        "history": summary["history"],
    }
    print(json.dumps(report["training"]["history"][-1]), flush=True)

if stage in ("all", "train", "accept"):
    questions, tokens = (4, 8) if smoke else (80, 256)
    llm = LLM(
        model=model,
        device=device,
        dtype=dtype_name,
        max_num_seqs=questions,
        speculative="mtp",
        num_speculative_tokens=3,
        speculative_model=head_dir,
        kv_cache_memory_gb=1 if smoke else 4,  # several trainings may share the GPU
    )
    prompts = [
        {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": t}])}
        for t in first_turns("mtbench", questions)
    ]
    before = llm.get_metrics()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    sync()
    report["acceptance"] = {
        "k": 3,
        "questions": questions,
        "max_tokens": tokens,
        "batch_size": questions,
        "seconds": time.perf_counter() - start,
        **acceptance(before, llm.get_metrics(), 3),
    }
    print(json.dumps(report["acceptance"]), flush=True)
    del llm

if stage in ("all", "speed"):
    questions, tokens = (4, 8) if smoke else (80, 256)
    report["spec"] = run_spec_bench(
        model, [head_dir], 3, [16], questions, tokens, device, dtype_name, None
    )
    report["spec_batch1"] = run_spec_bench(
        model, [head_dir], 3, [1], 2 if smoke else 8, tokens // 2, device, dtype_name, None
    )

suffix = os.environ.get("HEAD_NAME", os.environ.get("SHARD", "").replace("/", "of"))
with open(os.path.join(out_dir, f"gpu_mtp_{stage}{'_' + suffix if suffix else ''}.json"), "w") as f:
    json.dump(report, f, indent=2, default=str)
