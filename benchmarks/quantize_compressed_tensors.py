"""Write a 16/32-bit Hugging Face checkpoint as a compressed-tensors 8-bit checkpoint, with the
compressed-tensors library's own compressors (``tests.fixtures.compressed_tensors_writer``),
in the layout of llm-compressor's presets:

    W8A8         int8 weights per channel, dynamic per-token int8 activations (int-quantized)
    FP8_DYNAMIC  fp8 weights per channel, dynamic per-token fp8 activations (float-quantized)
    FP8          fp8 weights per tensor, static per-tensor fp8 activations calibrated on the
                 lines of --calibration-file (float-quantized)

Plain min-max scales (no SmoothQuant / GPTQ), so quality is the scheme's floor, not
llm-compressor's best. For perplexity and speed runs against the bf16 original:

    python benchmarks/quantize_compressed_tensors.py Qwen2-0.5B W8A8 /tmp/qwen2-0.5b-w8a8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# tests/fixtures is in the checkout, not in the package (and pagedllm too, when not installed).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.fixtures.compressed_tensors_writer import write_w8a8  # noqa: E402

#: Preset -> (weight type, weight strategy, activations).
PRESETS = {"W8A8": ("int", "channel", "token"), "FP8_DYNAMIC": ("float", "channel", "token"),
           "FP8": ("float", "tensor", "static")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("scheme", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--calibration-file", type=Path, help="text, one sample per line (FP8's static scales)")
    parser.add_argument("--num-samples", type=int, default=64)
    args = parser.parse_args()
    calibration = None
    if args.calibration_file is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.src)
        lines = [line for line in args.calibration_file.read_text().splitlines() if line.strip()][: args.num_samples]
        calibration = [tokenizer(line)["input_ids"][:512] for line in lines]
    write_w8a8(args.src, args.out, *PRESETS[args.scheme], calibration=calibration)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
