"""Re-quantize a GGUF file's linear weights (as llama.cpp's ``llama-quantize TYPE --pure``
would, for the types the ``gguf`` package can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), keeping
its metadata (tokenizer included) and its other tensors. For benchmarks: pagedllm and
llama.cpp then run the very same file.

    python benchmarks/quantize_gguf.py benchmarks/.peers/gguf/qwen2-0.5b-shape-bf16.gguf Q4_0 OUT.gguf
"""

from __future__ import annotations

import argparse
import re

import gguf
import numpy as np

#: GGUF names of the linear weights (llama.cpp's ``--pure`` quantizes these and keeps the rest).
LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("type", choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
    parser.add_argument("out")
    args = parser.parse_args()
    reader = gguf.GGUFReader(args.src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    qtype = gguf.GGMLQuantizationType[args.type]
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType[f"MOSTLY_{args.type}"])
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if LINEAR.search(tensor.name):
            weights = gguf.dequantize(data, tensor.tensor_type).reshape(tuple(reversed([int(d) for d in tensor.shape])))
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
