#!/usr/bin/env bash
# One prepared run on a lent CUDA machine (the `device` tool): install the Python packages its
# image lacks from wheels carried in .whl/, run the test suite on the GPU, then the
# throughput and latency benchmarks against HF transformers on the same GPU. Everything it
# prints also lands in $OUT (tests-*.log, junit-*.xml, bench-*.json).
#
#   STAGES="tests bench" bash benchmarks/cuda_check.sh      # both (default)
#   TESTS="tests/engine/test_greedy_equality.py" STAGES=tests bash benchmarks/cuda_check.sh
#   STAGES="tests spec" BENCH_PROMPTS=1 ...   # speculative decoding's rows (issue 16) on the GPU
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests bench spec"}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

if [[ $STAGES == *tests* ]]; then
  FIRST=${TESTS:-"tests/engine/test_greedy_equality.py tests/worker tests/attention/test_backends.py tests/engine tests/model_executor tests/lora tests/spec_decode tests/structured_output"}
  timeout ${TESTS_TIMEOUT_S:-200} python3 -m pytest -q -p no:cacheprovider --timeout 90 -rf \
    --junitxml="$OUT/junit-core.xml" $FIRST 2>&1 | tail -n 60 | tee "$OUT/tests-core.log"
  if [ -z "${TESTS:-}" ]; then
    timeout ${SERVER_TESTS_TIMEOUT_S:-150} python3 -m pytest -q -p no:cacheprovider --timeout 90 -rf \
      --junitxml="$OUT/junit-server.xml" tests/entrypoints 2>&1 | tail -n 40 | tee "$OUT/tests-server.log"
  fi
fi

if [[ $STAGES == *bench* ]]; then
  CKPT=/tmp/qwen2-0.5b-shape
  python3 benchmarks/make_checkpoint.py --preset qwen2-0.5b-shape --out $CKPT > /dev/null || exit 1
  for n in ${BENCH_PROMPTS:-1 64 256}; do
    timeout 120 python3 -m pagedllm.entrypoints.cli bench throughput --model $CKPT --dtype bfloat16 \
      --num-prompts $n --input-len 128 --output-len 128 --ignore-eos --compare hf --hf-max-batch-size $n \
      --max-num-seqs 256 --output-json "$OUT/bench-throughput-$n.json" 2>&1 | grep -v '^INFO\|it/s' | tail -n 14
  done
  timeout 90 python3 -m pagedllm.entrypoints.cli bench latency --model $CKPT --dtype bfloat16 \
    --batch-size 1 --input-len 128 --output-len 128 --output-json "$OUT/bench-latency-1.json" 2>&1 | tail -n 8
fi

if [[ $STAGES == *spec* ]]; then
  CKPT=/tmp/qwen2-0.5b-shape
  [ -d $CKPT ] || python3 benchmarks/make_checkpoint.py --preset qwen2-0.5b-shape --out $CKPT > /dev/null || exit 1
  python3 benchmarks/make_checkpoint.py --preset qwen2-draft-shape --out /tmp/qwen2-draft-shape --seed 1 > /dev/null || exit 1
  python3 benchmarks/make_spec_ceiling.py --target $CKPT --out-target /tmp/ceiling-target --out-draft /tmp/ceiling-draft > /dev/null || exit 1
  SPEC="timeout 100 python3 benchmarks/spec_decode_bench.py --output-len 128 --max-model-len 1024 --rounds 2 --kv-cache-memory-bytes 4294967296"
  $SPEC --model pagedllm/assets/pagedllm-default --batch-sizes 1 --input-len 256 --dataset-name repeat \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' \
    --output-json "$OUT/bench-spec-ngram.json" 2>&1 | grep -v '^INFO\|it/s' | tail -n 8
  $SPEC --model /tmp/ceiling-target --batch-sizes 1 8 --input-len 128 \
    --speculative-config '{"model": "/tmp/ceiling-draft", "num_speculative_tokens": 4}' \
    --output-json "$OUT/bench-spec-ceiling.json" 2>&1 | grep -v '^INFO\|it/s' | tail -n 10
  $SPEC --model $CKPT --batch-sizes 1 8 --input-len 128 \
    --speculative-config '{"model": "/tmp/qwen2-draft-shape", "num_speculative_tokens": 4}' \
    --output-json "$OUT/bench-spec-random-draft.json" 2>&1 | grep -v '^INFO\|it/s' | tail -n 10
fi
