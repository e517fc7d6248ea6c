"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): Llama's layer with q/k/v and gate/up fused in
the checkpoint (``qkv_proj``, ``gate_up_proj``: our fused layers load them whole, each
rank its rows), ``sliding_window`` on every layer, and the rope of ``rope_parameters``
(transformers' ``modeling_phi3``)."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (``LlamaForCausalLM``'s interface; the fused checkpoint tensors need no mapping)."""
