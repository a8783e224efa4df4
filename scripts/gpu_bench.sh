#!/usr/bin/env bash
# On the lent GPU, in one device call: the GPU tests, then the decode benchmark (tokens/s and
# GPU idle fraction at batch 1, 8, 16 and 64; with and without overlap and MTP).
# Usage: scripts/gpu_bench.sh MODEL.gguf OUT_DIR   (the repository root is the working dir)
set -u
model=$1 out=$2
export TANDEM_MODEL=$model PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_overlap.py ${GPU_TESTS:-} 2>&1 | tail -25 | tee "$out/gpu_tests.txt"
python3 -m tandem.cli bench decode --device cuda --dtype bfloat16 --model "$model" \
  --batch-sizes ${BATCH_SIZES:-1,8,16,64} --max-tokens ${MAX_TOKENS:-256} --modes plain,overlap,mtp,mtp+overlap \
  --num-speculative-tokens 3 --speculative-model tandem/heads/smollm2-135m-instruct \
  --kv-cache-memory-gb 16 --out-dir "$out" 2>&1 | grep --line-buffered -v Warn
