"""What the Llama-family mixture-of-experts models share: ``SparseMoeBlock`` (router, routed
experts, optional gated shared expert) and ``LlamaMoEForCausalLM`` (the Llama decoder with that
block on its sparse layers, and the loading of expert tensors).

Layout as transformers' Mixtral / Qwen2-MoE / Qwen3-MoE modules: ``mlp.gate`` the router
[E, H], ``mlp.experts`` the routed experts (our ``FusedMoE``), ``mlp.shared_expert`` a dense
SwiGLU MLP whose output is scaled by ``sigmoid(mlp.shared_expert_gate(x))`` (Qwen2-MoE).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.fused_moe.layer import STACKED_EXPERT_TENSORS
from pagedllm.model_executor.layers.linear import ReplicatedLinear
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.model_executor.models.pipeline_stage import other_stage_prefixes

#: ``<layer>.experts.<id>.<projection>.<tensor>``: one expert's matrix (the Hub's layout), its
#: ``weight`` or a quantized format's tensors (``qweight``, ``scales`` ...: ``FusedMoE``'s
#: ``w13_<tensor>`` / ``w2_<tensor>``).
_EXPERT_TENSOR = re.compile(r"(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<tensor>\w+)")
#: ``<layer>.experts.<gate_up_proj|down_proj>``: every expert's, stacked (transformers' modules).
_STACKED_TENSOR = re.compile(r"(?P<layer>.+\.experts)\.(?P<proj>\w+)")


class SparseMoeBlock(nn.Module):
    """x [T, H] -> [T, H]: the router ``gate`` (replicated, unquantized) picks ``top_k`` of
    ``num_experts`` experts per token, ``experts`` (``FusedMoE``, all-reduced over the
    tensor-parallel ranks) sums their weighted outputs; with ``shared_expert_intermediate_size``
    a shared expert's output times ``sigmoid(shared_expert_gate(x))`` is added (Qwen2-MoE)."""

    def __init__(self, config: PretrainedConfig, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, quant_config: Optional[QuantizationConfig], prefix: str,
                 shared_expert_intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts, top_k, hidden, intermediate_size, reduce_results=True, renormalize=renormalize,
            quant_config=quant_config, prefix=f"{prefix}.experts", activation=config.hidden_act,
        )
        self.shared_expert: Optional[LlamaMLP] = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, quant_config, f"{prefix}.shared_expert",
                                          intermediate_size=shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaMoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose ``make_mlp`` returns a ``SparseMoeBlock`` on sparse layers.

    Class attributes: ``expert_projections``, the checkpoint's name of each expert matrix ->
    ``FusedMoE`` shard id ("w1" gate, "w2" down, "w3" up); ``checkpoint_renames``, (checkpoint
    name part, module name part) pairs applied to every tensor name first (Mixtral's
    ``block_sparse_moe`` is our ``mlp``).
    """

    expert_projections: dict[str, str] = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the expert tensors (per expert, or stacked over the experts) into the layers'
        ``FusedMoE`` and every other tensor as ``LlamaForCausalLM.load_weights`` does; returns
        the parameter names loaded.

        Raises:
            ValueError: a tensor with no matching parameter (an unknown expert matrix, an
                expert id past the layer's experts), a shape that does not fit, or a
                ``FusedMoE`` layer left without some expert's matrix (named in the message).
        """
        moe_layers = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        loaded: set[str] = set()
        loaded |= super().load_weights(self._route_experts(weights, moe_layers, other_stage_prefixes(self), loaded))
        for name, layer in moe_layers.items():
            missing = layer.missing_weights()
            if missing:
                raise ValueError(f"The checkpoint lacks expert weights of {name}: {', '.join(missing[:8])}.")
        return loaded

    def _route_experts(self, weights: Iterable[tuple[str, torch.Tensor]], moe_layers: dict[str, FusedMoE],
                       other_stages: tuple[str, ...], loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Load the expert tensors of ``weights`` (adding their parameters' names to ``loaded``)
        and yield the others, renamed."""
        for name, tensor in weights:
            for old, new in self.checkpoint_renames:
                name = name.replace(old, new)
            match = _EXPERT_TENSOR.fullmatch(name) or _STACKED_TENSOR.fullmatch(name)
            if match is None or ".experts." not in name:
                yield name, tensor
                continue
            if name.startswith(other_stages):
                continue
            layer = moe_layers.get(match["layer"])
            if layer is None:
                raise ValueError(f"Checkpoint tensor {name!r} has no matching expert layer in {type(self).__name__}.")
            loaded.add(self._load_expert(layer, match, name, tensor))

    def _load_expert(self, layer: FusedMoE, match: re.Match, name: str, tensor: torch.Tensor) -> str:
        """Load one expert tensor into ``layer``; returns the parameter's name."""
        proj = match["proj"]
        if "expert" in match.groupdict():
            shard_id = self.expert_projections.get(proj)
            if shard_id is None:
                raise ValueError(
                    f"Checkpoint tensor {name!r}: {proj!r} is not an expert matrix of {type(self).__name__} "
                    f"(expected {', '.join(self.expert_projections)})."
                )
            param_name = f"{'w2' if shard_id == 'w2' else 'w13'}_{match['tensor']}"
            param = getattr(layer, param_name, None)
            if not isinstance(param, nn.Parameter):
                held = sorted({n.split("_", 1)[1] for n, _ in layer.named_parameters(recurse=False)})
                raise ValueError(
                    f"Checkpoint tensor {name!r} has no matching parameter: the experts of {match['layer']} hold "
                    f"{', '.join(held)} ({type(layer.quant_method).__name__})."
                )
            getattr(param, "weight_loader", layer.weight_loader)(param, tensor, name, shard_id, int(match["expert"]))
        else:
            if proj not in STACKED_EXPERT_TENSORS:
                raise ValueError(
                    f"Checkpoint tensor {name!r} has no matching parameter (stacked expert tensors: "
                    f"{', '.join(STACKED_EXPERT_TENSORS)})."
                )
            layer.load_stacked_experts(name, tensor, proj)
            param_name = "w2_weight" if proj == "down_proj" else "w13_weight"
        return f"{match['layer']}.{param_name}"
