"""Routers: router logits -> (top-k weights, top-k expert ids) per token, as pure functions
(vLLM's ``FusedMoE.select_experts`` semantics; the math of transformers' router modules).

Every function takes ``router_logits`` [T, E] (any float dtype) and returns
``(topk_weights [T, k] float32, topk_ids [T, k] int64)``; the order of the k entries of a
row is not part of the contract (the expert outputs are summed).

- ``softmax_topk``: softmax over all E experts, the k largest; with ``renormalize`` the k
  weights are divided by their sum (Mixtral, Qwen3-MoE's ``norm_topk_prob``; transformers'
  ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``).
- ``grouped_topk``: DeepSeek-V3's sigmoid (or softmax) scores, plus ``e_score_correction_bias``
  for the choice only; experts in ``num_expert_group`` groups, a group scored by the sum of its
  two best biased scores (without a bias: by its best score, DeepSeek-V2's
  ``group_limited_greedy``; vLLM's rule), the ``topk_group`` best groups kept, the k best
  experts in them; the weights are the unbiased scores, renormalised (+1e-20) with
  ``renormalize``, times ``routed_scaling_factor`` (``DeepseekV3TopkRouter``,
  ``DeepseekV2TopkRouter``; V2's "greedy" is one group).
- ``topk_softmax``: the k largest logits, then a softmax over those k only (gpt-oss's
  ``GptOssTopKRouter``).
- ``topk_sigmoid``: the k largest logits, each through a sigmoid on its own (Llama 4's
  ``Llama4Router``, whose experts take the weight on their input:
  ``FusedMoE(apply_router_weight_on_input=True)``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

#: ``(router_logits [T, E], top_k, renormalize) -> (topk_weights, topk_ids)``: a model's own router.
RoutingFunction = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]

SCORING_FUNCS = ("softmax", "sigmoid")


def _check_top_k(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [num_tokens, num_experts], got shape {tuple(router_logits.shape)}.")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k {top_k} must be between 1 and the number of experts {router_logits.shape[1]}.")


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over the experts, the ``top_k`` largest, optionally renormalised."""
    _check_top_k(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest logits, softmax over those only (sums to one: ``renormalize`` is moot)."""
    _check_top_k(router_logits, top_k)
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(logits, dim=-1), ids


def topk_sigmoid(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest logits, each one's sigmoid (float32) its weight (not renormalised:
    ``renormalize`` is ignored, as transformers' ``Llama4Router`` has none)."""
    _check_top_k(router_logits, top_k)
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(logits.float()), ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "sigmoid",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited routing (see the module docstring).

    Raises:
        ValueError: groups that do not split the experts, ``topk_group`` out of range, fewer
            experts in the kept groups than ``top_k``, or an unknown ``scoring_func``.
    """
    _check_top_k(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group {num_expert_group} does not divide the {num_experts} experts.")
    per_group = num_experts // num_expert_group
    if not 1 <= topk_group <= num_expert_group or topk_group * per_group < top_k:
        raise ValueError(
            f"topk_group {topk_group} of {num_expert_group} groups ({per_group} experts each) cannot hold top_k {top_k}."
        )
    scores = _scores(router_logits.float(), scoring_func)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = choice.view(num_tokens, num_expert_group, per_group)
    if e_score_correction_bias is None:
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    kept_groups = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"Unknown scoring_func {scoring_func!r}; expected one of {', '.join(SCORING_FUNCS)}.")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    use_grouped_topk: bool = False,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    scoring_func: str = "softmax",
    e_score_correction_bias: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: Optional[RoutingFunction] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``FusedMoE.select_experts``: ``grouped_topk`` with ``use_grouped_topk``, else
    ``custom_routing_function`` when given (``topk_softmax`` for gpt-oss), else ``softmax_topk``
    (``scoring_func`` "softmax" only there). Returns ``(topk_weights [T, k] float32,
    topk_ids [T, k] int64)``.

    Raises:
        ValueError: see the functions; grouped routing without its group sizes; a
            ``scoring_func`` other than "softmax" without grouped routing.
    """
    if use_grouped_topk:
        if num_expert_group is None or topk_group is None:
            raise ValueError("Grouped top-k routing needs num_expert_group and topk_group.")
        return grouped_topk(router_logits, top_k, renormalize, num_expert_group, topk_group, scoring_func,
                            e_score_correction_bias, routed_scaling_factor)
    if custom_routing_function is not None:
        weights, ids = custom_routing_function(router_logits, top_k, renormalize)
        return weights.float(), ids.long()
    if scoring_func != "softmax":
        raise ValueError(f"scoring_func {scoring_func!r} needs grouped top-k routing (use_grouped_topk).")
    return softmax_topk(router_logits, top_k, renormalize)
