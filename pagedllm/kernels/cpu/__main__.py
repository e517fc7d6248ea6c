"""``python -m pagedllm.kernels.cpu [--every-level]``: build (or load from the cache) the C++
CPU kernels for this CPU now — ``make install`` runs it — so that the first ``pagedllm serve``
does not wait for the build. ``--every-level`` also builds the lower instruction-set levels
the kernel tests run (``pagedllm.kernels.isa.check_levels``; ``make test`` asks for it). Prints the levels built; exits 0 also when the kernels cannot
be built (the engine then uses its portable PyTorch code, and the warning above says why)."""

from __future__ import annotations

import argparse
import sys

from pagedllm.kernels import cpu, isa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.kernels.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--every-level", action="store_true", help="also build the lower levels the kernel tests run")
    args = parser.parse_args(argv)
    if not cpu.is_available():
        print("pagedllm CPU kernels unavailable: the portable PyTorch code will be used.")
        return 0
    print(f"pagedllm CPU kernels ready ({cpu.build_info()}).")
    if args.every_level:
        for level in isa.check_levels()[:-1]:
            with cpu.using_isa(level):
                print(f"pagedllm CPU kernels ready ({cpu.build_info()}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
