"""``FusedMoE`` (vLLM's name): a mixture-of-experts feed-forward layer, the routed experts of
one decoder layer, their weights stacked and held by a ``FusedMoEMethodBase``.

Sharding over the tensor-parallel group (the router is replicated by the model):

- tensor parallelism (default): every rank holds every expert, its 1 / tp of each expert's
  intermediate dimension: rows of each half ([gate | up]) of W13, columns of W2; the ranks'
  partial sums are added by one all-reduce (``reduce_results``), as the dense MLP's down_proj.
- expert parallelism (``enable_expert_parallel``): rank r holds whole experts, a contiguous
  range (``expert_range``: vLLM's placement, the first E % tp ranks one expert more), and
  computes the tokens routed to them; the same all-reduce combines the ranks' outputs.
- over data-parallel engines (``-dp N --enable-expert-parallel``: a data-parallel group,
  ``get_dp_group``): engine r holds ``expert_range(E, N, r)`` and each forward exchanges the
  engines' tokens (``dp_exchange``); ``run_idle_exchanges`` is the pass of an engine without tokens.

Checkpoint tensors arrive per expert through ``weight_loader`` (``shard_id`` "w1" gate, "w3"
up, "w2" down; vLLM's ids), or stacked for all experts (``load_stacked_experts``: the 3-D
``gate_up_proj`` / ``down_proj`` of transformers' expert modules). An ungated expert
(``activation`` "relu2_no_mul": down(relu(up x) ** 2), Nemotron-H's) has no gate: its W13 is
the up matrix alone, loaded as "w1" (vLLM's), from transformers' stacked ``up_proj`` too. ``missing_weights`` names
what the checkpoint has not provided.

At DEBUG level the logger of this module reports, per forward, the tokens routed to each
expert (load balance): ``PAGEDLLM_LOGGING_LEVEL=DEBUG``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed import (
    divide,
    expert_parallel_enabled,
    get_dp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.model_executor.layers.activation import ReLUSquaredActivation, SiluAndMul, SwigluOAIAndMul
from pagedllm.model_executor.layers.fused_moe.dp_exchange import exchange_experts
from pagedllm.model_executor.layers.fused_moe.methods import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from pagedllm.model_executor.layers.fused_moe.router import RoutingFunction, select_experts
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.utils import load_weight_part

logger = logging.getLogger(__name__)

#: Checkpoint matrices of an expert, as ``weight_loader``'s shard ids: gate, down, up.
EXPERT_SHARD_IDS = ("w1", "w2", "w3")
#: The experts' gated activations on [gate | up] (vLLM's names): SwiGLU, and gpt-oss's clamped one.
GATED_MOE_ACTIVATIONS = ("silu", "swigluoai")
#: The experts' activations: the gated ones, and the ungated squared ReLU (vLLM's "relu2_no_mul").
MOE_ACTIVATIONS = (*GATED_MOE_ACTIVATIONS, "relu2_no_mul")
#: transformers' stacked expert tensors -> the shard ids they hold, in order along their rows
#: (``up_proj``: an ungated expert's only W13 matrix).
STACKED_EXPERT_TENSORS = {"gate_up_proj": ("w1", "w3"), "up_proj": ("w1",), "down_proj": ("w2",)}


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first global expert id, number of experts) held by rank ``ep_rank`` of ``ep_size``:
    contiguous ranges, the first ``num_experts % ep_size`` ranks holding one more (vLLM's
    ``determine_expert_map``).

    Raises:
        ValueError: fewer experts than ranks (a rank would hold none).
    """
    if num_experts < ep_size:
        raise ValueError(f"Expert parallelism over {ep_size} ranks needs at least {ep_size} experts, got {num_experts}.")
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (ep_rank < extra)


class FusedMoE(nn.Module):
    """The routed experts of a layer: ``forward(hidden_states [T, H], router_logits [T, E])
    -> [T, H]`` (hidden_states' dtype; summed over the ranks when ``reduce_results``).

    Args:
        num_experts, top_k: experts E, and experts per token k.
        hidden_size, intermediate_size: H, and each expert's I (all ranks together).
        params_dtype: the weights' dtype (None: torch's default dtype).
        reduce_results: whether ``forward`` all-reduces over the tensor-parallel ranks.
        renormalize, use_grouped_topk, num_expert_group, topk_group, scoring_func,
        routed_scaling_factor, e_score_correction_bias, custom_routing_function: the routing
            (``router.select_experts``).
        activation: the experts' activation on [gate | up]: "silu" (SwiGLU) or "swigluoai"
            (``SwigluOAIAndMul(swiglu_alpha, swiglu_limit)``, gpt-oss's clamped SwiGLU); or
            "relu2_no_mul", relu(W13 x) ** 2 with W13 the up matrix alone [I, H] per expert
            (``is_act_and_mul`` False; the unquantized method and its int8 form).
        has_bias: each expert's W13 and W2 have a bias (``w13_bias`` [E, 2 x I] as [gate |
            up], ``w2_bias`` [E, H]; gpt-oss), loaded with ``shard_id`` as the weights'.
        swiglu_alpha, swiglu_limit: the "swigluoai" activation's sigmoid gain and clamp.
        apply_router_weight_on_input: each token enters its expert scaled by its routing
            weight (in the token's dtype), the expert's output then added unweighted (vLLM's
            name; Llama 4's experts); top_k must be 1.
        quant_config: ``get_quant_method(self, prefix)`` may return a ``FusedMoEMethodBase``;
            None (or a None answer): ``UnquantizedFusedMoEMethod``.
        prefix: the layer's name in the model (``model.layers.0.mlp.experts``).
        enable_expert_parallel: whole experts per rank (see the module docstring); None:
            ``pagedllm.distributed.expert_parallel_enabled()`` (``--enable-expert-parallel``).

    Raises:
        ValueError: an activation not built, biases the method does not apply, an I the
            tensor-parallel size does not divide, fewer experts than expert-parallel ranks, or
            a quantization method for linear layers only; apply_router_weight_on_input with
            top_k above 1.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: Optional[torch.dtype] = None,
        reduce_results: bool = False,
        renormalize: bool = True,
        use_grouped_topk: bool = False,
        num_expert_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        custom_routing_function: Optional[RoutingFunction] = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: Optional[torch.Tensor] = None,
        activation: str = "silu",
        enable_expert_parallel: Optional[bool] = None,
        has_bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        apply_router_weight_on_input: bool = False,
    ) -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"FusedMoE activation {activation!r} is not built (built: {', '.join(MOE_ACTIVATIONS)}).")
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError(
                f"{prefix}: apply_router_weight_on_input needs top_k 1 (one expert per token), got {top_k}.")
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.has_bias, self.activation = has_bias, activation
        #: Whether W13 is [gate | up] under a gated activation (vLLM's name); else up alone.
        self.is_act_and_mul = activation in GATED_MOE_ACTIVATIONS
        self.global_num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.reduce_results, self.prefix = reduce_results, prefix
        self.routing = dict(
            renormalize=renormalize, use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group,
            topk_group=topk_group, scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            custom_routing_function=custom_routing_function,
        )
        self.e_score_correction_bias = e_score_correction_bias
        self.tp_size, self.tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        expert_parallel = expert_parallel_enabled() if enable_expert_parallel is None else enable_expert_parallel
        dp_group = get_dp_group()
        #: The data-parallel engines this layer's experts are spread over (None: this engine holds them).
        self.dp_group = dp_group if expert_parallel and dp_group.world_size > 1 else None
        self.use_ep = expert_parallel and (self.tp_size > 1 or self.dp_group is not None)
        ep_size, ep_rank = ((dp_group.world_size, dp_group.rank_in_group) if self.dp_group is not None
                            else (self.tp_size, self.tp_rank) if self.use_ep else (1, 0))
        self.moe_tp_size, self.moe_tp_rank = (1, 0) if self.use_ep else (self.tp_size, self.tp_rank)
        self.expert_start, self.local_num_experts = expert_range(num_experts, ep_size, ep_rank)
        self.register_buffer("expert_map", self._expert_map(), persistent=False)
        self.intermediate_size_per_partition = divide(intermediate_size, self.moe_tp_size)
        self.act_fn = (SiluAndMul() if activation == "silu" else ReLUSquaredActivation()
                       if activation == "relu2_no_mul" else SwigluOAIAndMul(swiglu_alpha, swiglu_limit))
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        if method is not None and not isinstance(method, FusedMoEMethodBase):
            raise ValueError(f"{prefix}: quantization method {type(method).__name__} does not apply to FusedMoE experts.")
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        if has_bias and not self.quant_method.supports_bias:
            raise ValueError(f"{prefix}: {type(self.quant_method).__name__} does not apply expert biases.")
        if not self.is_act_and_mul and not self.quant_method.supports_ungated:
            raise ValueError(f"{prefix}: {type(self.quant_method).__name__} does not hold ungated experts "
                             f"(activation {activation!r}).")
        self.quant_method.create_weights(
            self, self.local_num_experts, hidden_size, self.intermediate_size_per_partition,
            params_dtype or torch.get_default_dtype(), weight_loader=self.weight_loader,
        )
        self._loaded: set[tuple[int, str]] = set()

    def _expert_map(self) -> Optional[torch.Tensor]:
        """[E] int64: global expert id -> local id, -1 for experts held elsewhere (None: all here)."""
        if self.local_num_experts == self.global_num_experts:
            return None
        expert_map = torch.full((self.global_num_experts,), -1, dtype=torch.int64)
        local = slice(self.expert_start, self.expert_start + self.local_num_experts)
        expert_map[local] = torch.arange(self.local_num_experts)
        return expert_map

    def local_expert(self, expert_id: int) -> Optional[int]:
        """This rank's index of global expert ``expert_id``, or None if another rank holds it.

        Raises:
            ValueError: an id outside 0 .. E - 1.
        """
        if not 0 <= expert_id < self.global_num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} does not exist (the layer has {self.global_num_experts}).")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.local_num_experts else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
                      expert_id: int) -> None:
        """Copy this rank's part of expert ``expert_id``'s checkpoint matrix ``shard_id`` ("w1"
        gate [I, H], "w3" up [I, H], "w2" down [H, I]; named ``weight_name``) into ``param``;
        nothing if another rank holds the expert. Into ``w13_bias`` / ``w2_bias`` the matrix's
        bias ("w1", "w3" [I]; "w2" [H], whole on every rank).

        Raises:
            ValueError: an unknown shard id or expert, or a shape that does not fit.
        """
        if shard_id not in self._shard_ids():
            raise ValueError(f"{weight_name}: unknown expert shard id {shard_id!r} (expected "
                             f"{', '.join(self._shard_ids())}).")
        local = self.local_expert(expert_id)
        if local is None:
            return
        inter = self.intermediate_size_per_partition
        if shard_id == "w2":
            target = param.data[local]
            dim = 1 if target.dim() == 2 else None  # a bias [H] is not split
        else:
            target, dim = param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter), 0
        try:
            load_weight_part(target, loaded_weight, dim, self.moe_tp_rank, self.moe_tp_size)
        except ValueError as error:
            raise ValueError(f"Checkpoint tensor {weight_name!r}: {error}") from None
        self.record_loaded(param, shard_id, expert_id)

    def record_loaded(self, param: nn.Parameter, shard_id: str, expert_id: int) -> None:
        """Note that ``param``'s part for expert ``expert_id``'s matrix ``shard_id`` is loaded
        (``weight_loader`` does; a method's own loader of a parameter it checks, not copies,
        calls it for ``missing_weights``)."""
        self._loaded.add((expert_id, self._matrix_part(shard_id, param)))

    def load_stacked_experts(self, name: str, loaded_weight: torch.Tensor, kind: str) -> None:
        """Load a tensor holding every expert (``kind`` "gate_up_proj": [E, 2 x I, H], gate rows
        then up rows; "up_proj" [E, I, H] of ungated experts; "down_proj": [E, H, I];
        transformers' stacked expert parameters).

        Raises:
            ValueError: an unknown kind or a shape that does not fit.
        """
        shard_ids = STACKED_EXPERT_TENSORS.get(kind)
        other_kind = kind == "up_proj" if self.is_act_and_mul else kind == "gate_up_proj"
        if shard_ids is None or other_kind:
            raise ValueError(f"Checkpoint tensor {name!r}: unknown stacked expert tensor {kind!r} for "
                             f"{'gated' if self.is_act_and_mul else 'ungated'} experts.")
        if loaded_weight.dim() != 3 or loaded_weight.shape[0] != self.global_num_experts:
            raise ValueError(
                f"Checkpoint tensor {name!r} has shape {tuple(loaded_weight.shape)}; expected "
                f"[{self.global_num_experts}, ...] (one matrix per expert)."
            )
        param = self.w2_weight if kind == "down_proj" else self.w13_weight
        for expert_id, matrix in enumerate(loaded_weight):
            if len(shard_ids) == 1:
                self.weight_loader(param, matrix, name, shard_ids[0], expert_id)
                continue
            if matrix.shape[0] % 2:
                raise ValueError(f"Checkpoint tensor {name!r}: {matrix.shape[0]} rows do not split into gate and up.")
            for shard_id, part in zip(shard_ids, matrix.chunk(2, dim=0)):
                self.weight_loader(param, part, name, shard_id, expert_id)

    def missing_weights(self) -> list[str]:
        """``"expert <id> <shard id>"`` (and ``"... <shard id> <tensor>"`` for each other expert
        parameter: ``bias`` with ``has_bias``, a quantized method's ``scales`` ...) for each
        matrix of this rank's experts not loaded yet."""
        held = range(self.expert_start, self.expert_start + self.local_num_experts)
        parts = [self._matrix_part(shard_id, param) for shard_id in self._shard_ids()
                 for name, param in self.named_parameters(recurse=False)
                 if name.startswith("w2_" if shard_id == "w2" else "w13_")]
        return [f"expert {e} {s}" for e in held for s in parts if (e, s) not in self._loaded]

    def _matrix_part(self, shard_id: str, param: nn.Parameter) -> str:
        """``shard_id`` for the expert weights themselves (``w13_weight`` / ``w2_weight``), else
        ``"<shard id> <tensor>"`` (``w13_bias`` -> "w1 bias", ``w2_scales`` -> "w2 scales")."""
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        tensor = name.split("_", 1)[1]
        return shard_id if tensor == "weight" else f"{shard_id} {tensor}"

    def _shard_ids(self) -> tuple[str, ...]:
        """The expert matrices this layer holds: all of ``EXPERT_SHARD_IDS``; no "w3" (up) when ungated."""
        return EXPERT_SHARD_IDS if self.is_act_and_mul else ("w1", "w2")

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        return select_experts(router_logits, self.top_k, e_score_correction_bias=self.e_score_correction_bias,
                              **self.routing)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(router_logits)
        if logger.isEnabledFor(logging.DEBUG):
            counts = torch.bincount(topk_ids.reshape(-1), minlength=self.global_num_experts).tolist()
            logger.debug("%s: %d tokens; tokens per expert %s", self.prefix, hidden_states.shape[0], counts)
        if self.apply_router_weight_on_input:
            hidden_states = hidden_states * topk_weights.to(hidden_states.dtype)
            topk_weights = torch.ones_like(topk_weights)
        if self.dp_group is not None:
            out = exchange_experts(self.dp_group, hidden_states, topk_weights, topk_ids,
                                   lambda x, weights, ids: self.quant_method.apply(self, x, weights, ids))
        else:
            out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.local_num_experts}/{self.global_num_experts} (from {self.expert_start}), "
                f"top_k={self.top_k}, hidden={self.hidden_size}, intermediate={self.intermediate_size_per_partition}, "
                f"ep={self.use_ep}")


def run_idle_exchanges(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Pass zero tokens through each ``FusedMoE`` of ``model`` whose experts are spread over
    data-parallel engines, in module order (the forward's order), so that this engine serves
    its experts to the other engines' tokens in a step with none of its own (vLLM's dummy
    batch). Returns how many layers it passed (0: nothing to exchange)."""
    passed = 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.dp_group is not None:
            hidden = torch.empty((0, module.hidden_size), dtype=dtype, device=device)
            module(hidden, torch.empty((0, module.global_num_experts), dtype=torch.float32, device=device))
            passed += 1
    return passed
