"""Write a constructed pair for speculative decoding's ceiling: a target whose layers after the
first ``--keep-layers`` add nothing, and a draft that is exactly those first layers.

    python benchmarks/make_spec_ceiling.py --target benchmarks/checkpoints/qwen2-0.5b-shape \\
        --out-target benchmarks/checkpoints/qwen2-0.5b-ceiling-target \\
        --out-draft benchmarks/checkpoints/qwen2-0.5b-ceiling-draft

NOT a real model: a measuring device (issue 16's "draft = a copy of the target, acceptance
1.0"). A literal copy of the target as its own draft costs k full decode steps per verifying
step, so it cannot beat plain decoding; what the issue's row is after is the mechanism's
ceiling, the speed-up when every draft is accepted and drafting is cheap. Here:

- the target keeps every weight of ``--target`` (so each decode step reads and computes all
  24 layers of the 0.5B shape, as the real checkpoint does), except that in layers
  ``keep-layers`` .. N - 1 the two projections that write into the residual stream
  (``self_attn.o_proj`` and ``mlp.down_proj``, which have no bias in Llama / Qwen2) are
  zero, so those layers add exactly 0 to the residual and the target's logits are those of
  its first ``keep-layers`` layers, its final norm and its lm_head;
- the draft is those first layers, the final norm and the embeddings / lm_head, with
  ``num_hidden_layers = keep-layers``: the same function as the target, at a fraction of its
  cost (one layer of 24 plus the 32000 x 896 lm_head, for the 0.5B shape).

Greedy drafts then match the target's tokens except where the two forwards round
differently (different matmul row counts), so the measured acceptance is about 1.0; the
benchmark states it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

#: Projections that write into the residual stream, zeroed in the target's later layers.
RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def split_checkpoint(tensors: dict, keep_layers: int) -> tuple[dict, dict]:
    """(target, draft) tensors from a Llama / Qwen2 state dict (see the module docstring).

    Raises:
        ValueError: ``keep_layers`` < 1, or a residual writer has a bias (it would not add 0).
    """
    if keep_layers < 1:
        raise ValueError(f"--keep-layers must be at least 1, got {keep_layers}")
    target, draft = {}, {}
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        layer = int(match.group(1)) if match else None
        if match and match.group(2) in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            raise ValueError(f"{name}: a residual writer with a bias cannot be made to add 0")
        zero = layer is not None and layer >= keep_layers and match.group(2) in RESIDUAL_WRITERS
        target[name] = tensor.clone().zero_() if zero else tensor
        if layer is None or layer < keep_layers:
            draft[name] = tensor
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a Llama / Qwen2 checkpoint folder (one safetensors file)")
    parser.add_argument("--out-target", required=True)
    parser.add_argument("--out-draft", required=True)
    parser.add_argument("--keep-layers", type=int, default=1, help="layers the target really uses (the draft's)")
    args = parser.parse_args()
    source = Path(args.target)
    files = sorted(source.glob("*.safetensors"))
    if len(files) != 1:
        raise SystemExit(f"{source}: expected one .safetensors file, found {len(files)}")
    target, draft = split_checkpoint(load_file(files[0]), args.keep_layers)
    config = json.loads((source / "config.json").read_text())
    for out, tensors, num_layers in ((args.out_target, target, config["num_hidden_layers"]),
                                     (args.out_draft, draft, args.keep_layers)):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for extra in source.iterdir():
            if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
                shutil.copy(extra, out / extra.name)
        layer_config = dict(config, num_hidden_layers=num_layers)
        if "layer_types" in layer_config:
            layer_config["layer_types"] = layer_config["layer_types"][:num_layers]
        (out / "config.json").write_text(json.dumps(layer_config, indent=2) + "\n")
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        print(f"wrote {out} ({num_layers} layers, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
