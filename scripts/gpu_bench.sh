#!/usr/bin/env bash
# On the lent GPU, in one device call per stage list: the GPU tests and the benchmarks of
# issue 6, each writing JSON under OUT_DIR (the repository root is the working directory).
#
# Usage: STAGES="tests decode" scripts/gpu_bench.sh MODEL.gguf OUT_DIR
#   tests       the `gpu`-marked tests (Triton vs torch, graphs vs eager vs HF, overlap;
#               with two GPUs also tensor parallelism over NCCL, an engine on cuda:1 and
#               the NCCL connector; GPU_TESTS names other test files or ids)
#   engine-tests  the CPU suite's engine tests on the GPU (conftest.py's make_llm engines on
#               cuda in fp32, where greedy identity is exact): ENGINE_TESTS (default the
#               penalties and structured-output tests, with and without MTP and overlap)
#   decode      SmolLM2 decode tok/s and GPU idle at BATCH_SIZES (default 1,8,64) in MODES
#               (default plain,overlap,mtp,mtp+overlap), MAX_TOKENS (default 128) each;
#               batch 1 decodes QUESTIONS (default 16; 0: one) MT-Bench first turns one
#               after the other, PROFILE_QUESTIONS (default 4; 0: all) of them profiled;
#               then STEADY_REQUESTS (default 512, 8x the largest batch; 0: none) ShareGPT
#               requests at once at the largest batch size, outputs of the dataset's
#               lengths capped at STEADY_MAX_TOKENS (default 256), in STEADY_ROUNDS
#               (default 5) rounds alternating the modes, all engines alive at once; every request at
#               TEMPERATURE (default 0: greedy) and TOP_P (default 1); other batch sizes time
#               their generate FIXED_REPEATS times (default 3) and report the median;
#               DRAFT_SCHEDULE (ROWS:DRAFTS,...) the MTP engines' draft schedule; HEAD names an MTP head
#               directory (default the model's). With ORACLE set (rates,
#               e.g. 0.19,0.456: expected acceptance lengths 3.0 and 2.0 at k = 3; 0: 4.0)
#               a second run on ORACLE_MODEL (default dummy:llama3-8b-peaked: random
#               weights whose greedy choices are not near-ties; no trained head):
#               ORACLE_MODES (default overlap) at ORACLE_BATCH_SIZES (default 1,64), which
#               record greedy outputs, then mtp+overlap with the oracle proposer replaying
#               them at each corruption rate; ORACLE_STEADY_REQUESTS (default 256) steady
#               requests; its own STAGE_TIMEOUT
#   idle        where batch 1's GPU idle is: scripts/question_timeline.py (the host's code
#               during each wait of the device inside a question, MTP and plain; PROFILED
#               questions, default 2; TRACE=1 keeps the gzipped traces) and
#               scripts/layer_chain_bench.py (the layers' chain with the output projection
#               by cuBLAS or by the Triton GEMM with dependent launch)
#   latency     Llama-3-8B shape (dummy weights), then MODEL, batch 1, 128 prompt + 256 output
#               tokens: ms per token against the bandwidth roofline, with a kernel profile
#   throughput  the same model, NUM_PROMPTS (default 1000) ShareGPT requests offline, with
#               transformers on the first HF_PROMPTS (default 64; 0: none) for reference and
#               PROFILE_PROMPTS (default 200) profiled (HOST_PROFILE=1: all of them again
#               under cProfile; PROFILE_STEPS=FIRST:COUNT[,...]: windows of steps of a rerun
#               under the CUDA profiler); THROUGHPUT_CONFIGS (default
#               "1024:16384") lists max_num_seqs:max_num_batched_tokens pairs, one run each
#   pd          PD_MODEL (default the 8B shape) as a prefill and a decode process on this
#               GPU (KV over CUDA IPC) against one mixed process: decode inter-token latency
#               under long prompts, KV GB/s, handoff latency; PD_EXTRA adds options
#               (e.g. "--mtp": MTP on both roles and on the mixed process)
#   tp          (2 GPUs) the 8B shape at tensor_parallel_size 1 and 2 (torchrun): batch 1
#               latency, then NUM_PROMPTS ShareGPT requests offline (Tandem only); TP_SIZES
#               (default "1 2") picks the sizes
#   pd2         (2 GPUs) PD with the prefill instance on cuda:0 and the decode instance on
#               cuda:1, KV over NCCL, then both on cuda:0 over CUDA IPC (co-located); each
#               run also measures one mixed instance on cuda:0
#
# Where the data packages cannot be installed (a bare GPU machine), scripts/device_shims.sh
# stands in for them (MODEL.gguf, SHAREGPT_JSON, MTBENCH_JSONL).
set -u -o pipefail  # a stage's status is its command's, not the filter's after it
model=$1 out=$2
export TANDEM_MODEL=$model PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device entry's rule), also in processes started below.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/device_shims.sh"  # the data packages, stood in for where missing
# Engine processes a killed run left behind would share the GPUs with the next run: end them
# (the spawned engine cores), and show what still holds GPU memory.
clean_gpus() {
  pkill -9 -f "multiprocessing.spawn" 2>/dev/null && sleep 2
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader 2>/dev/null \
    | sed 's/^/   gpu /'
}
for stage in ${STAGES:-tests decode latency throughput}; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests)
      timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        ${GPU_TESTS:-tests/unit/test_triton_attention.py tests/e2e/test_cuda_graphs.py tests/e2e/test_overlap.py tests/e2e/test_tensor_parallel.py tests/unit/test_nccl_connector.py tests/unit/test_cuda_ipc_connector.py} \
        > "$out/gpu_tests.txt" 2>&1
      status=$?; grep -v Warn "$out/gpu_tests.txt" | tail -30; (exit $status) ;;
    engine-tests)
      TANDEM_TEST_DEVICE=cuda TANDEM_TEST_DTYPE=float32 TANDEM_TEST_KV_CACHE_GB=4 timeout "${TESTS_TIMEOUT:-560}" \
        python3 -m pytest -q -p no:cacheprovider \
        ${ENGINE_TESTS:-tests/e2e/test_penalties.py tests/e2e/test_structured_output.py} \
        > "$out/engine_tests.txt" 2>&1
      status=$?; grep -v Warn "$out/engine_tests.txt" | tail -30; (exit $status) ;;
    decode)
      status_all=0
      rows="--questions ${QUESTIONS:-16} --profile-questions ${PROFILE_QUESTIONS:-4}"
      rows="$rows --steady-max-tokens ${STEADY_MAX_TOKENS:-256} --num-speculative-tokens 3"
      rows="$rows --temperature ${TEMPERATURE:-0} --top-p ${TOP_P:-1} --steady-rounds ${STEADY_ROUNDS:-5}"
      rows="$rows --fixed-repeats ${FIXED_REPEATS:-3} ${DRAFT_SCHEDULE:+--draft-schedule $DRAFT_SCHEDULE}"
      timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench decode --device cuda --model "$model" \
        --batch-sizes "${BATCH_SIZES:-1,8,64}" --max-tokens "${MAX_TOKENS:-128}" \
        --modes "${MODES:-plain,overlap,mtp,mtp+overlap}" $rows ${HEAD:+--speculative-model "$HEAD"} \
        --steady-state-requests "${STEADY_REQUESTS:-512}" \
        --kv-cache-memory-gb 16 --out-dir "$out" 2>&1 | grep --line-buffered -v Warn \
        || status_all=$?
      if [ -n "${ORACLE:-}" ]; then
        clean_gpus
        timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench decode --device cuda \
          --model "${ORACLE_MODEL:-dummy:llama3-8b-peaked}" --batch-sizes "${ORACLE_BATCH_SIZES:-1,64}" \
          --max-tokens "${MAX_TOKENS:-128}" --modes "${ORACLE_MODES:-overlap}" $rows \
          --steady-state-requests "${ORACLE_STEADY_REQUESTS:-256}" --oracle-corruption "$ORACLE" \
          --kv-cache-memory-gb 16 --out-dir "$out" 2>&1 | grep --line-buffered -v Warn \
          || status_all=$?
      fi
      (exit $status_all) ;;
    idle)
      status_all=0
      timeout "${STAGE_TIMEOUT:-290}" python3 scripts/question_timeline.py \
        "$model" "$out" --profiled "${PROFILED:-2}" ${TRACE:+--trace} 2>&1 \
        | grep --line-buffered -v Warn || status_all=$?
      clean_gpus
      timeout "${STAGE_TIMEOUT:-290}" python3 scripts/layer_chain_bench.py \
        "$out/layer-chain.json" 2>&1 | grep --line-buffered -v Warn || status_all=$?
      (exit $status_all) ;;
    latency)
      for m in dummy:llama3-8b "$model"; do
        timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench latency --device cuda --model "$m" \
          --batch-size 1 --input-len 128 --output-len 256 --profile --out-dir "$out" 2>&1 \
          | grep --line-buffered -v Warn
      done ;;
    throughput)
      # One run per SEQS:TOKENS pair (max_num_seqs : max_num_batched_tokens); transformers
      # and the profile only with the first.
      status_all=0 extra="--hf-num-prompts ${HF_PROMPTS:-64} --profile-prompts ${PROFILE_PROMPTS:-200}"
      [ "${HF_PROMPTS:-64}" = 0 ] && extra="--skip-hf --profile-prompts ${PROFILE_PROMPTS:-200}"
      [ -n "${HOST_PROFILE:-}" ] && extra="$extra --host-profile"
      [ -n "${PROFILE_STEPS:-}" ] && extra="$extra --profile-steps $PROFILE_STEPS"
      for config in ${THROUGHPUT_CONFIGS:-1024:16384}; do
        timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench throughput --device cuda --model dummy:llama3-8b \
          --dataset sharegpt --num-prompts "${NUM_PROMPTS:-1000}" --max-prompt-len 1024 \
          --max-output-len 1024 --max-num-seqs "${config%:*}" \
          --max-num-batched-tokens "${config#*:}" --kv-cache-memory-gb 80 $extra \
          --hf-batch-size 32 --out-dir "$out" 2>&1 | grep --line-buffered -v -e Warn -e "it/s" \
          || status_all=$?
        python3 -c "import json,glob; r=json.load(open(sorted(glob.glob('$out/throughput-*.json'))[-1])); print(json.dumps({k: v for k, v in r['tandem_steps'].items() if k != 'series'})); [print(json.dumps(w)) for w in r.get('tandem_step_profiles', [])]"
        extra="--skip-hf"
      done
      (exit $status_all) ;;
    pd)
      timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench pd --device cuda \
        --model "${PD_MODEL:-dummy:llama3-8b}" --kv-connector cuda_ipc --kv-cache-memory-gb 16 \
        --num-decode 32 --decode-output-len 256 --num-long 16 --long-prompt-len 2000 \
        ${PD_EXTRA:-} --out-dir "$out" 2>&1 | grep --line-buffered -v -e Warn -e "^[IWE]1" ;;
    tp)
      status_all=0
      for n in ${TP_SIZES:-1 2}; do
        run="python3 -m tandem.cli"
        [ "$n" -gt 1 ] && run="python3 -m torch.distributed.run --nproc-per-node $n -m tandem.cli"
        for eager in "" --enforce-eager; do  # eager only if the graphs failed
          timeout "${LATENCY_TIMEOUT:-150}" $run bench latency --device cuda --model dummy:llama3-8b \
            --batch-size 1 --input-len 128 --output-len 256 --tensor-parallel-size "$n" $eager \
            --out-dir "$out" 2>&1 | grep --line-buffered -v -e Warn -e "^\*\*\*" && break
          status_all=$?
        done
        timeout "${STAGE_TIMEOUT:-290}" $run bench throughput --device cuda --model dummy:llama3-8b \
          --dataset sharegpt --num-prompts "${NUM_PROMPTS:-1000}" --max-prompt-len 1024 \
          --max-output-len 1024 --max-num-seqs 256 --kv-cache-memory-gb 80 --skip-hf \
          --tensor-parallel-size "$n" --out-dir "$out" 2>&1 \
          | grep --line-buffered -v -e Warn -e "it/s" -e "req/s" || status_all=$?
      done
      (exit $status_all) ;;
    pd2)
      status_all=0
      for placement in "nccl cuda:0 cuda:1" "cuda_ipc cuda:0 cuda:0"; do
        set -- $placement
        clean_gpus
        timeout "${STAGE_TIMEOUT:-290}" python3 -m tandem.cli bench pd --device cuda:0 \
          --prefill-device "$2" --decode-device "$3" \
          --model "${PD_MODEL:-dummy:llama3-8b}" --kv-connector "$1" --kv-cache-memory-gb 16 \
          --num-decode 32 --decode-output-len 256 --num-long 16 --long-prompt-len 2000 \
          --out-dir "$out" 2>&1 | grep --line-buffered -v -e Warn -e "^[IWE]1" || status_all=$?
      done
      (exit $status_all) ;;
    *) echo "unknown stage $stage" ;;
  esac
  status=$?
  clean_gpus
  # 124: the stage ran past its timeout (its output above is cut short).
  [ "$status" -eq 0 ] || echo "== $stage exited with status $status"
done
echo "== done $(date +%T)"
