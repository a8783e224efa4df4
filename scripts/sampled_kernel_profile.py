"""Top CUDA kernels of sampled MTP + overlap decoding at batch 64, one process.

Usage: python scripts/sampled_kernel_profile.py MODEL.gguf TEMPERATURE (on CUDA): 64 MT-Bench
first turns, 96 tokens each, once to warm up and once under torch.profiler; prints the
kernels by total device time."""

import sys

from torch.profiler import ProfilerActivity, profile

from tandem import LLM, SamplingParams
from tandem.bench.decode_runs import mtbench_prompts

llm = LLM(
    model=sys.argv[1],
    device="cuda",
    speculative="mtp",
    num_speculative_tokens=3,
    max_num_seqs=64,
    kv_cache_memory_gb=16,
)
prompts = mtbench_prompts(llm, 64)
params = SamplingParams(temperature=float(sys.argv[2]), max_tokens=96, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=70))
