"""Write the benchmark checkpoints (random weights, Hugging Face layout) without downloads.

    python benchmarks/make_checkpoint.py --preset qwen2-0.5b-shape --out benchmarks/checkpoints/qwen2-0.5b-shape
    python benchmarks/make_checkpoint.py --preset tiny-llama --out benchmarks/checkpoints/tiny-llama --dtype float32
    python benchmarks/make_checkpoint.py --preset qwen2-draft-shape --out benchmarks/checkpoints/qwen2-draft-shape --seed 1

The presets are the checkpoints of /work/shared/peers.md ("Checkpoints used"), so numbers
measured here compare with the peers' table:

- ``tiny-llama``: LlamaForCausalLM, hidden 256, 4 layers, 4 heads / 2 KV heads, FFN 688,
  untied embeddings, vocab 32000 (19.3M parameters).
- ``qwen2-0.5b-shape``: Qwen2ForCausalLM with Qwen2.5-0.5B's dimensions (hidden 896,
  24 layers, 14 heads / 2 KV heads, FFN 4864, tied embeddings, rope_theta 1e6) and
  vocab 32000 (386.6M parameters, 773 MB in bf16; about 30 s on 2 cores).
- ``qwen2-draft-shape``: a small Qwen2ForCausalLM with the 0.5B shape's vocabulary, head
  size and context (hidden 256, 2 layers, 4 heads / 2 KV heads, FFN 704, tied embeddings):
  a speculative-decoding draft for ``qwen2-0.5b-shape`` whose random proposals the target
  (almost) never accepts, to measure the cost of drafting.
- ``gemma3-1b-shape``: Gemma3ForCausalLM with Gemma 3 1B's layers (sliding window 512 on 5 of
  every 6 layers) and vocab 32000.
- ``qwen3-30b-a3b-cut``: Qwen3MoeForCausalLM with Qwen3-30B-A3B's per-layer shape (128 experts
  of 768, top-8), 6 layers, vocab 32000.
- ``qwen3-next-cut``: Qwen3NextForCausalLM with Qwen3-Next-80B-A3B's per-layer shape, 8 layers
  (6 Gated DeltaNet, 2 full attention), 64 experts, vocab 32000; ``qwen3-next-cut-all-attention``:
  the same with full attention on every layer.
- ``llama3-8b-shape``: LlamaForCausalLM with Llama 3 8B's dimensions (hidden 4096, 32 layers,
  32 heads / 8 KV heads, FFN 14336, vocab 128256, untied; 8.0B parameters, 16.1 GB in bf16),
  written one tensor at a time into 2 GB shards (peak memory about one shard; some minutes):
  the int4 8B shape of the start-up benchmarks (``--quantization int4``).
- ``qwen2.5-vl-3b-cut``: Qwen2_5_VLForConditionalGeneration with Qwen2.5-VL-3B's per-layer
  shapes, layers cut about eightfold: a vision tower of 4 blocks (hidden 1280, 16 heads, SwiGLU
  FFN 3420, 14-pixel patches merged 2 x 2, windows of 112 pixels, the last block full attention
  as every eighth one of the 3B), merged to 2048, and a language model of 4 layers (hidden 2048,
  16 heads / 2 KV heads, FFN 11008, tied embeddings, rope_theta 1e6, mrope sections 16/24/24),
  vocab 32000 plus the Qwen-VL tokens (0.49B parameters, 0.98 GB in bf16); its image processor keeps images of
  56^2 .. 448^2 pixels (a 448 x 448 image is 256 embeddings).
  ``qwen2.5-vl-tiny``: the tests' tiny Qwen2.5-VL (``tests.multimodal.checkpoints``) with tied
  embeddings, for the benchmark's own test.

All use the 32000-token byte-level BPE tokenizer of ``tests.fixtures.checkpoints``
with the ChatML chat template (``qwen2.5-vl-tiny``: the tests' 1024-token one). Weights are
created directly in ``--dtype`` (default bfloat16, as the peers measured), so peak memory is
about twice the checkpoint size (the Qwen2.5-VL presets: drawn in float32, saved in ``--dtype``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# tests/fixtures is in the checkout, not in the package (and pagedllm too, when not installed).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.fixtures.checkpoints import make_checkpoint, make_streamed_checkpoint  # noqa: E402
from tests.multimodal.checkpoints import make_qwen_vl_checkpoint  # noqa: E402

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(
        arch="LlamaForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tokenizer_vocab_size=32000,
    ),
    "qwen2-0.5b-shape": dict(
        arch="Qwen2ForCausalLM",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tokenizer_vocab_size=32000,
    ),
}

PRESETS["qwen2-draft-shape"] = dict(
    PRESETS["qwen2-0.5b-shape"], hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=704,
)

#: Gemma 3 1B's layers (hidden 1152, 26 layers of 4 heads / 1 KV head of 256, FFN 6912, a
#: 512-token window on 5 of every 6 layers, local rope base 1e4, global 1e6) with vocab 32000.
PRESETS["gemma3-1b-shape"] = dict(
    arch="Gemma3ForCausalLM",
    hidden_size=1152,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    intermediate_size=6912,
    sliding_window=512,
    query_pre_attn_scalar=256,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tokenizer_vocab_size=32000,
)

#: Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768,
#: top-8) cut to 6 layers and vocab 32000, to fit 24 GiB (~3.7B parameters, 7.4 GB in bf16).
PRESETS["qwen3-30b-a3b-cut"] = dict(
    arch="Qwen3MoeForCausalLM",
    hidden_size=2048,
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tokenizer_vocab_size=32000,
)

#: Qwen3-Next-80B-A3B's layer shape (hidden 2048; gated attention, 16 heads / 2 KV heads of 256,
#: partial rotary 0.25; Gated DeltaNet, 16 key heads / 32 value heads of 128, conv 4; experts of
#: 512, top-10, a shared expert of 512) cut to 8 layers (6 linear-attention, 2 full), 64 experts
#: and vocab 32000 (~1.9B parameters, 3.8 GB in bf16).
PRESETS["qwen3-next-cut"] = dict(
    arch="Qwen3NextForCausalLM",
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    partial_rotary_factor=0.25,
    intermediate_size=5120,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=10,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    tie_word_embeddings=False,
    rope_theta=10000000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tokenizer_vocab_size=32000,
)

#: ``qwen3-next-cut`` with every layer full attention: the same parameters but for the mixers,
#: the baseline of how decode slows with context.
PRESETS["qwen3-next-cut-all-attention"] = dict(
    PRESETS["qwen3-next-cut"], layer_types=["full_attention"] * 8,
)

#: Qwen2.5-VL-3B's vision blocks and language-model layers, 4 of each (see the module docstring).
PRESETS["qwen2.5-vl-3b-cut"] = dict(
    arch="Qwen2_5_VLForConditionalGeneration",
    vision_config=dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3],
                       out_hidden_size=2048, tokens_per_second=2, hidden_act="silu"),
    text_config=dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                     intermediate_size=11008, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    image_processor=dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=448 * 448),
    tie_word_embeddings=True,
    tokenizer_vocab_size=32000,
)
#: Llama 3 8B's shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocab 128256,
#: rope_theta 5e5; 8.0B parameters, 16.1 GB in bf16), written one tensor at a time
#: (``streamed``): the int4 8B-shape model of the start-up benchmarks.
PRESETS["llama3-8b-shape"] = dict(
    arch="LlamaForCausalLM",
    streamed=True,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tokenizer_vocab_size=32000,
)
#: A 2-layer cut of it with a small vocabulary, for the streamed writer's own test.
PRESETS["llama3-8b-shape-2l"] = dict(PRESETS["llama3-8b-shape"], num_hidden_layers=2, hidden_size=256,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                     vocab_size=None)
PRESETS["qwen2.5-vl-tiny"] = dict(arch="Qwen2_5_VLForConditionalGeneration", tie_word_embeddings=True)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> Path:
    """Parse the command line, write the checkpoint, print a one-line summary, return its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-shard-size", default=None, help='e.g. "200MB": several safetensors files + index'
    )
    args = parser.parse_args(argv)

    preset = dict(PRESETS[args.preset])
    arch = preset.pop("arch")
    start = time.perf_counter()
    if preset.pop("streamed", False):
        out = make_streamed_checkpoint(Path(args.out), arch, dtype=DTYPES[args.dtype], seed=args.seed, **preset)
    elif arch.endswith("VLForConditionalGeneration"):
        out = make_qwen_vl_checkpoint(Path(args.out), arch, args.seed, dtype=DTYPES[args.dtype], **preset)
    else:
        out = make_checkpoint(
            args.out,
            arch,
            dtype=DTYPES[args.dtype],
            seed=args.seed,
            max_shard_size=args.max_shard_size,
            **preset,
        )
    elapsed = time.perf_counter() - start
    weight_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        f"wrote {args.preset} ({arch}, {args.dtype}) to {out}: "
        f"{weight_bytes / 1e6:.1f} MB of weights in {elapsed:.1f} s"
    )
    return out


if __name__ == "__main__":
    main()
