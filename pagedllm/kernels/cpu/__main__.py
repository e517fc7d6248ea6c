"""``python -m pagedllm.kernels.cpu``: build (or load from the cache) the C++ CPU kernels for
this CPU now — ``make install`` runs it — so that the first ``pagedllm serve`` does not wait
for the build. Prints the level built; exits 0 also when the kernels cannot be built (the
engine then uses its portable PyTorch code, and the warning above says why)."""

from __future__ import annotations

import sys

from pagedllm.kernels import cpu


def main() -> int:
    if cpu.is_available():
        print(f"pagedllm CPU kernels ready ({cpu.build_info()}).")
    else:
        print("pagedllm CPU kernels unavailable: the portable PyTorch code will be used.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
