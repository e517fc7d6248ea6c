"""EAGLE / EAGLE-3 head checkpoints for tests, in the layout of the published ones
(SafeAILab/EAGLE; see ``pagedllm.model_executor.models.llama_eagle``).

- ``make_eagle_head``: a random head for a target checkpoint (its proposals are almost never
  accepted: the mechanism's cost bound, and greedy-equality tests);
- ``make_bigram_target`` + ``make_exact_eagle_head``: a one-layer target whose output depends
  on the current token only, and heads whose weights reproduce it exactly, so every draft
  is accepted (the mechanism's ceiling: token shifting, chaining, the d2t mapping).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from pagedllm.testing.checkpoints import make_checkpoint

_HEAD_ARCHITECTURES = {"eagle": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}


def _head_config(target: dict, method: str, **overrides: Any) -> dict:
    """A Llama config.json of one layer with ``target``'s sizes (EAGLE heads are model_type
    llama whatever their target)."""
    config = {
        "architectures": [_HEAD_ARCHITECTURES[method]],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target.get("num_key_value_heads") or target["num_attention_heads"],
        "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
        "num_hidden_layers": 1,
        "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0),
        "rope_scaling": target.get("rope_scaling"),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def _write(out_dir: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _layer_names(prefix: str) -> list[str]:
    return [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"] + [
        f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def _d2t(draft_vocab: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's maps for a draft vocabulary (target ids, in draft-id order): ``d2t`` [Vd]
    int64 offsets (target = draft + d2t[draft]) and ``t2d`` [V] bool (target id in it)."""
    return torch.tensor(draft_vocab) - torch.arange(len(draft_vocab)), torch.tensor(draft_vocab)


def make_eagle_head(
    out_dir: str | os.PathLike,
    target: str | os.PathLike,
    method: str,
    *,
    seed: int = 0,
    draft_vocab_size: Optional[int] = None,
    aux_layer_ids: Optional[list[int]] = None,
    fc_bias: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a random EAGLE (``method`` "eagle") or EAGLE-3 ("eagle3") head for the
    checkpoint ``target`` and return its folder (config.json, model.safetensors).

    Weights have std 1 / sqrt(fan_in) (o_proj / down_proj 8 / sqrt(fan_in), as
    ``make_checkpoint``), norms uniform in [0.5, 1.5], from a generator seeded with ``seed``.
    An EAGLE head carries the target's embeddings (as published ones do; not loaded) and,
    with ``fc_bias``, an ``fc.bias`` (config.json ``"bias": true``). An EAGLE-3 head's draft
    vocabulary is ``draft_vocab_size`` target ids (default: half of them; every other id,
    where a trained head takes the most frequent ones), with ``d2t`` / ``t2d``;
    ``aux_layer_ids`` becomes config.json's
    ``eagle_aux_hidden_state_layer_ids`` (None: left out, vLLM's default applies).
    ``config_overrides`` replace config.json fields (e.g. ``hidden_size`` for a mismatched head).
    """
    target_config = json.loads((Path(target) / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    overrides: dict[str, Any] = dict(config_overrides)
    if method == "eagle":
        overrides["bias"] = fc_bias
    else:
        vocab = target_config["vocab_size"]
        overrides["draft_vocab_size"] = draft_vocab_size or vocab // 2
        if aux_layer_ids is not None:
            overrides["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    config = _head_config(target_config, method, **overrides)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    prefix = "layers.0" if method == "eagle" else "midlayer"
    attn_in = hidden if method == "eagle" else 2 * hidden
    shapes = dict(zip(_layer_names(prefix), [(q_size, attn_in), (kv_size, attn_in), (kv_size, attn_in),
                                             (hidden, q_size), (inter, hidden), (inter, hidden), (hidden, inter)]))
    norms = [f"{prefix}.post_attention_layernorm.weight", f"{prefix}.input_layernorm.weight"]
    if method == "eagle":
        shapes["fc.weight"] = (hidden, 2 * hidden)
    else:
        shapes["fc.weight"] = (hidden, 3 * hidden)
        shapes["lm_head.weight"] = (config["draft_vocab_size"], hidden)
        norms += [f"{prefix}.hidden_norm.weight", "norm.weight"]
    tensors = {}
    for name, shape in shapes.items():
        gain = 8.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        tensors[name] = torch.randn(shape, generator=generator) * gain / math.sqrt(shape[1])
    for name in norms:
        tensors[name] = torch.rand(hidden, generator=generator) + 0.5
    if method == "eagle":
        tensors["embed_tokens.weight"] = _target_tensors(target)["model.embed_tokens.weight"]
        if fc_bias:
            tensors["fc.bias"] = torch.randn(hidden, generator=generator) * 0.2
    else:
        draft_vocab = list(range(0, config["vocab_size"], 2))[: config["draft_vocab_size"]]
        tensors["d2t"], t2d_ids = _d2t(draft_vocab)
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill_(0, t2d_ids, True)
    return _write(out_dir, config, tensors)


def _target_tensors(target: str | os.PathLike) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(target).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def make_bigram_target(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A one-layer random Llama (``make_checkpoint``'s tiny shape) whose next token depends
    on the current token only: o_proj is zero (attention adds nothing), embedding rows have
    RMS 1, and the final norm's weights are ones. ``make_exact_eagle_head`` reproduces it."""
    out = make_checkpoint(out_dir, "LlamaForCausalLM", num_hidden_layers=1, seed=seed)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"].zero_()
    tensors["model.norm.weight"].fill_(1.0)
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


#: q/k scale of the exact EAGLE-3 head: attention scores of a token with itself exceed
#: those with any other token by hundreds, so each position attends to its own token only.
_SELF_ATTENTION_SCALE = 12.0


def make_exact_eagle_head(out_dir: str | os.PathLike, target: str | os.PathLike, method: str) -> Path:
    """An EAGLE / EAGLE-3 head for ``make_bigram_target``'s checkpoint ``target`` that
    predicts exactly the target's next token.

    The target's feature after token x is norm(e + mlp(post_norm(e))), e = embed(x). At
    position p the head reads token x_{p+1} and must produce that feature for it:

    - EAGLE: ``fc`` = [I | 0] passes embed(x_{p+1}) on (the feature read is dropped);
      o_proj is zero; post-attention
      norm and MLP are the target's; x + residual is the feature before the target's
      (all-ones) final norm, which does not change the argmax.
    - EAGLE-3: ``norm_before_residual`` with a zero ``hidden_norm`` drops the feature read
      (the target's, or the head's own from the step before), and one attention head of
      size hidden with q = k = c * embed and v = o = identity attends to its own token
      only, so the attention output is embed(x_{p+1}); post-attention norm, MLP and final
      norm are the target's. The draft vocabulary is the target's in reverse order (``d2t`` a
      permutation), so the mapping to target ids is exercised.
    """
    t = _target_tensors(target)
    target_config = json.loads((Path(target) / "config.json").read_text())
    hidden = target_config["hidden_size"]
    eye, zeros = torch.eye(hidden), torch.zeros(hidden, hidden)
    mlp = {f"mlp.{p}_proj.weight": t[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
    post_norm = {"post_attention_layernorm.weight": t["model.layers.0.post_attention_layernorm.weight"]}
    if method == "eagle":
        config = _head_config(target_config, method, bias=False)
        layer = {f"self_attn.{p}_proj.weight": t[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"}
        layer["self_attn.o_proj.weight"] = torch.zeros_like(t["model.layers.0.self_attn.o_proj.weight"])
        tensors = {"fc.weight": torch.cat((eye, zeros), dim=1),
                   **{f"layers.0.{n}": w for n, w in {**layer, **mlp, **post_norm}.items()}}
        return _write(out_dir, config, tensors)
    vocab = target_config["vocab_size"]
    config = _head_config(target_config, method, num_attention_heads=1, num_key_value_heads=1, head_dim=hidden,
                          draft_vocab_size=vocab, eagle_aux_hidden_state_layer_ids=[0, 0, 0],
                          norm_before_residual=True)
    qk = torch.cat((eye, zeros), dim=1) * _SELF_ATTENTION_SCALE  # [embeds ; normed feature] inputs
    layer = {"self_attn.q_proj.weight": qk, "self_attn.k_proj.weight": qk.clone(),
             "self_attn.v_proj.weight": torch.cat((eye, zeros), dim=1), "self_attn.o_proj.weight": eye.clone(),
             "input_layernorm.weight": torch.ones(hidden), "hidden_norm.weight": torch.zeros(hidden)}
    draft_vocab = list(range(vocab - 1, -1, -1))
    d2t, _ = _d2t(draft_vocab)
    tensors = {"fc.weight": torch.zeros(hidden, 3 * hidden), "norm.weight": t["model.norm.weight"],
               "lm_head.weight": t["lm_head.weight"][torch.tensor(draft_vocab)], "d2t": d2t,
               "t2d": torch.ones(vocab, dtype=torch.bool),
               **{f"midlayer.{n}": w for n, w in {**layer, **mlp, **post_norm}.items()}}
    return _write(out_dir, config, tensors)
