"""Re-quantize a GGUF file's linear weights (as llama.cpp's ``llama-quantize TYPE --pure``
would, for the types the ``gguf`` package can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the
K-quants Q4_K, Q5_K, Q6_K with ``tests.fixtures.gguf_kquant_writer``'s plain rounding),
keeping its metadata (tokenizer included) and its other tensors. ``--v-down-type Q6_K`` with
Q4_K gives Q4_K_M's mix (attn_v and ffn_down in Q6_K). Rows that are not whole 256-input
super-blocks fall back as llama-quantize does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; all
of Qwen2-0.5B's 896-input weights). For benchmarks: pagedllm and llama.cpp then run the very
same file.

    python benchmarks/quantize_gguf.py benchmarks/.peers/gguf/qwen2-0.5b-shape-bf16.gguf Q4_0 OUT.gguf
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np

# tests/fixtures is in the checkout, not in the package (and pagedllm too, when not installed).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.fixtures.gguf_kquant_writer import quantize_k  # noqa: E402

#: GGUF names of the linear weights (llama.cpp's ``--pure`` quantizes these and keeps the rest).
LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


#: llama-quantize's type for rows of a K-quant type that are not whole super-blocks.
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def file_type(linear_type: str, v_down_type: str | None) -> str:
    """``general.file_type``'s name for the mix: Q4_K / Q5_K alone are llama.cpp's "_S" files,
    with a wider attn_v / ffn_down its "_M" ones."""
    if linear_type in ("Q4_K", "Q5_K"):
        return linear_type + ("_M" if v_down_type else "_S")
    return linear_type


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("type", choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("out")
    parser.add_argument("--v-down-type", default=None, help="type of attn_v and ffn_down (default: TYPE)")
    args = parser.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType[f"MOSTLY_{file_type(args.type, args.v_down_type)}"])
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        match = LINEAR.search(tensor.name)
        if match:
            name = args.v_down_type if args.v_down_type and match.group(1) in ("attn_v", "ffn_down") else args.type
            weights = gguf.dequantize(data, tensor.tensor_type).reshape(tuple(reversed([int(d) for d in tensor.shape])))
            weights = weights.astype(np.float32)
            if name in K_FALLBACK and weights.shape[1] % 256:
                name = K_FALLBACK[name]
            qtype = gguf.GGMLQuantizationType[name]
            quantized = quantize_k(weights, name) if name.endswith("_K") else gguf.quants.quantize(weights, qtype)
            writer.add_tensor(tensor.name, quantized, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
