"""On the lent GPU: self-generated replies, MTP head distillation, then the MT-Bench spec
benchmark. Usage: gpu_mtp.py MODEL.gguf DATA.pt OUT_DIR STEPS"""

import json
import os
import sys
import time

import torch

from tandem import LLM, SamplingParams
from tandem.bench.spec import run_spec_bench
from tandem.train.mtp_distill import TrainConfig, pack_sequences, train_mtp

model, data_path, out_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
stage = sys.argv[5] if len(sys.argv) > 5 else "all"
# SMOKE=1 runs the same path on the CPU at toy sizes, to catch mistakes before GPU time.
smoke = os.environ.get("SMOKE") == "1"
device, dtype_name = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
head_dir = os.path.join(out_dir, "head")
report: dict = {"device": "cpu" if smoke else torch.cuda.get_device_name(),
                "torch": torch.__version__}

if stage in ("all", "train"):
    data = torch.load(data_path)
    if smoke:
        data = {"sequences": data["sequences"][:40], "self_prompts": data["self_prompts"][:4]}
    start = time.perf_counter()
    llm = LLM(model=model, device=device, max_num_seqs=128, kv_cache_memory_gb=1 if smoke else 8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in data["self_prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=8 if smoke else 192), use_tqdm=False)
    if not smoke:
        torch.cuda.synchronize()
    generated = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    report["self_generation"] = {"requests": len(generated), "seconds": time.perf_counter() - start,
                                 "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
    del llm
    sequences = data["sequences"] + generated
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    sequences = [sequences[i] for i in order]
    held_out = len(sequences) // 20
    train, held = pack_sequences(sequences[held_out:], 256), pack_sequences(sequences[:held_out], 256)
    report["data"] = {"train_rows": train.shape[0], "eval_rows": held.shape[0], "seq_len": 256}
    config = TrainConfig(steps=steps, batch_size=2 if smoke else 32, seq_len=256, lr=1e-3,
                         eval_every=500)
    start = time.perf_counter()
    _, summary = train_mtp(model, train, held, config, device, getattr(torch, dtype_name), head_dir,
                           progress=False)
    report["training"] = {"seconds": time.perf_counter() - start, "history": summary["history"]}
    print(json.dumps(report["training"]["history"][-1]), flush=True)

if stage in ("all", "bench"):
    questions, tokens = (4, 8) if smoke else (80, 256)
    report["spec"] = run_spec_bench(model, head_dir, 3, [16], questions, tokens, device,
                                    dtype_name, None)
    report["spec_batch1"] = run_spec_bench(model, head_dir, 3, [1], 2 if smoke else 8,
                                           tokens // 2, device, dtype_name, None)

with open(os.path.join(out_dir, f"gpu_mtp_{stage}.json"), "w") as f:
    json.dump(report, f, indent=2, default=str)
