#!/usr/bin/env bash
# The MTP head study (issue 22) on a machine of one or more GPUs, one device call per stage.
#
# Usage: scripts/gpu_head_study.sh MODEL.gguf DATA.pt OUT_DIR STAGE
#   gen    each visible GPU writes the base model's greedy replies (256 tokens) to its shard
#          of DATA.pt's prompts (scripts/prepare_mtp_data.py): OUT_DIR/self_generated_I.pt
#   train  the configurations all at once, round-robin over the GPUs (several may share
#          one), each for TRAIN_S seconds (default 480;
#          the time budget includes a minute for its MT-Bench acceptance):
#          CONFIGS="name:VAR=V,VAR=V name2:..." with scripts/gpu_mtp.py's variables
#          (NUM_LAYERS, CHAIN, SHAREGPT, SELF, SELF_REPEAT, INIT_HEAD, LR, TEACHER_T, FEATURES,
#          TRAIN_SEED);
#          the heads go to
#          OUT_DIR/NAME, the self-generated shards already in OUT_DIR are the replies
#   spec   `tandem bench spec` over HEADS (comma-separated head directories) on the 80
#          MT-Bench first turns and on 80 held-out ShareGPT first turns, at batch 80, k = 3,
#          256 tokens, with the plot of acceptance against training tokens; the two
#          datasets run at once on the first two GPUs when there are two
# The data packages are stood in for as scripts/device_shims.sh says.
set -u -o pipefail
model=$1 data=$2 out=$3 stage=$4
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/device_shims.sh"
gpus=$(nvidia-smi --list-gpus | wc -l)
mkdir -p "$out"
case $stage in
  gen)
    for i in $(seq 0 $((gpus - 1))); do
      CUDA_VISIBLE_DEVICES=$i SHARD=$i/$gpus python3 scripts/gpu_mtp.py "$model" "$data" "$out" 0 gen \
        > "$out/gen_$i.log" 2>&1 &
    done
    wait; tail -n 2 "$out"/gen_*.log ;;
  train)
    generated=$(ls "$out"/self_generated_*.pt 2>/dev/null | paste -sd, -)
    i=0
    for config in ${CONFIGS}; do
      name=${config%%:*} vars=${config#*:}
      (
        export CUDA_VISIBLE_DEVICES=$((i % gpus)) GENERATED=$generated HEAD_NAME=$name
        [ "$vars" != "$config" ] && for v in ${vars//,/ }; do export "${v?}"; done
        python3 scripts/gpu_mtp.py "$model" "$data" "$out" "${TRAIN_S:-480}" train > "$out/train_$name.log" 2>&1
      ) &
      i=$((i + 1))
    done
    wait; for f in "$out"/train_*.log; do echo "== $f"; tail -n 3 "$f"; done ;;
  spec)
    common="--device cuda --model $model --speculative-model $HEADS --batch-sizes 80"
    common="$common --num-questions 80 --max-tokens 256 --num-speculative-tokens 3 --kv-cache-memory-gb 8"
    CUDA_VISIBLE_DEVICES=0 python3 -m tandem.cli bench spec $common --dataset mtbench \
      --plot "$out/study-mtbench.png" --out-dir "$out" > "$out/spec_mtbench.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=$((1 % gpus)) python3 -m tandem.cli bench spec $common --dataset sharegpt \
      --plot "$out/study-sharegpt.png" --out-dir "$out" > "$out/spec_sharegpt.log" 2>&1 &
    wait; tail -n 12 "$out"/spec_*.log ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
