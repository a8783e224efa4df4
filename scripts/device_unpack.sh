# Sourced from the repository root at the start of every device call on a bare GPU machine:
# gathers the parts scripts/device_pack.py packed (the folders .gpu1 to .gpu3, one carried a
# call) under /tmp/stage, which lasts while the machine stays warm; once a file's parts are
# all there it is joined, the wheels installed (once), and MODEL, SHAREGPT_JSON and
# MTBENCH_JSONL exported for scripts/gpu_bench.sh and scripts/gpu_head_study.sh
# (DEVICE_STAGE: another place than /tmp/stage); TOKENIZER_GGUF, from the first call on, is
# the default model's tokenizer alone (what the dummy models borrow: `model=$TOKENIZER_GGUF;
# source scripts/device_shims.sh` before the model's parts are all there).
stage=${DEVICE_STAGE:-/tmp/stage}
mkdir -p "$stage"
for folder in .gpu1 .gpu2 .gpu3; do
  [ -d "$folder" ] && cp -r "$folder"/. "$stage"/
done
for count in "$stage"/*.parts; do  # NAME.parts holds how many parts NAME was split into
  [ -f "$count" ] || continue
  name=${count%.parts}
  parts=$(ls "$name".part[0-9] 2>/dev/null | wc -l)
  if [ ! -f "$name" ] && [ "$parts" -eq "$(cat "$count")" ]; then
    cat "$name".part[0-9] > "$name" && echo "joined ${name##*/}"
  fi
done
if [ -d "$stage/wheels" ] && [ ! -f "$stage/.installed" ]; then
  python3 -m pip install -q --no-deps "$stage"/wheels/*.whl && touch "$stage/.installed"
fi
model_parts=$(ls "$stage"/*.gguf.parts 2>/dev/null | head -n 1)
export MODEL=${model_parts%.parts} SHAREGPT_JSON=$stage/sharegpt.json
export MTBENCH_JSONL=$stage/question.jsonl
tokenizer=$(ls "$stage"/tokenizer/*.gguf 2>/dev/null | head -n 1)
export TOKENIZER_GGUF=$tokenizer
ls "$MODEL" "$SHAREGPT_JSON" 2>/dev/null || echo "not all parts staged yet"
