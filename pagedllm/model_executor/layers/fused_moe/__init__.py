"""Mixture-of-experts layers: ``FusedMoE`` (``layer``), its methods (``methods``), the
routers (``router``) and the grouped expert compute (``expert_groups``)."""

from pagedllm.model_executor.layers.fused_moe.layer import FusedMoE, expert_range
from pagedllm.model_executor.layers.fused_moe.methods import FusedMoEMethodBase, UnquantizedFusedMoEMethod

__all__ = ["FusedMoE", "FusedMoEMethodBase", "UnquantizedFusedMoEMethod", "expert_range"]
