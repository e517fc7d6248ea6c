"""Llama 4 (text): greedy token-identical to transformers (float32) under chunked prefill (steps
crossing chunk boundaries), preemption and prefix caching, on a checkpoint of three chunked
rope layers (24-token chunks, L2 q/k norms, llama3 rope) and one NoPE layer (temperature
tuning that the prompts' positions reach), dense and expert layers interleaved; the model runs
on TORCH_SDPA (CPU_ATTN has no chunked local attention) and its stacked experts load as
transformers holds them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from pagedllm.attention import selector
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.model_executor.layers.fused_moe.router import topk_sigmoid
from pagedllm.model_executor.models.llama4 import Llama4ForCausalLM
from tests.conftest import LLAMA3_ROPE_SCALING
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

#: 4 layers: chunked, chunked, chunked, NoPE (no_rope_layer_interval 4); experts on layers 1
#: and 3. floor_scale 8: the NoPE layer's query scale grows from position 7 on.
CONFIG = dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
              intermediate_size_mlp=64, interleave_moe_layer_step=2, attention_chunk_size=24, head_dim=16,
              floor_scale=8, attn_scale=0.5, max_position_embeddings=256,
              rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 32})


@pytest.fixture(scope="module")
def llama4(checkpoint_factory):
    return checkpoint_factory("Llama4ForCausalLM", seed=2, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(llama4, scenario):
    llm = assert_scenario(llama4, scenario, prompts_for(1024))
    assert llm.llm_engine.engine_core.kv_cache_manager.block_pool.null_block is not None


def test_chunked_prefill_steps_cross_chunk_boundaries(llama4):
    """Steps of 20 tokens over 8-token blocks: prefill chunks end at 20, 40, 60 ... across the
    24-token attention chunks, and the decodes cross them too."""
    prompts = prompts_for(1024, lengths=(23, 50, 70), seed=11)
    assert_scenario(llama4, "chunked_prefill", prompts, max_tokens=12, max_num_batched_tokens=20)


def test_runs_on_torch_sdpa_and_cpu_attn_is_refused_by_name():
    backend = selector.get_attn_backend(16, torch.float32, 8, uses_chunked_local_attention=True)
    assert backend is TorchSDPABackend
    with pytest.raises(ValueError, match="CPU_ATTN cannot run here: it has no chunked local attention"):
        selector.get_attn_backend(16, torch.float32, 8, "CPU_ATTN", uses_chunked_local_attention=True)


def test_stacked_experts_load_transposed(llama4):
    """``experts.gate_up_proj`` [E, H, 2 x I] (gate columns first) and ``down_proj`` [E, I, H]
    land as FusedMoE's [E, 2 x I, H] / [E, H, I]; the shared expert and router load by name."""
    with selector.set_attn_backend(TorchSDPABackend):
        model = Llama4ForCausalLM(AutoConfig.from_pretrained(llama4))
    weights = load_file(llama4 / "model.safetensors")
    model.load_weights(weights.items())
    experts = model.model.layers[1].mlp.experts
    gate_up = weights["model.layers.1.feed_forward.experts.gate_up_proj"]
    assert torch.equal(experts.w13_weight.data, gate_up.transpose(1, 2))
    assert torch.equal(experts.w2_weight.data, weights["model.layers.1.feed_forward.experts.down_proj"].transpose(1, 2))
    assert torch.equal(model.model.layers[1].mlp.router.weight, weights["model.layers.1.feed_forward.router.weight"])
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * CONFIG["intermediate_size_mlp"]


def test_sigmoid_router_equals_transformers():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    router = Llama4Router(Llama4TextConfig(hidden_size=8, num_local_experts=5, num_experts_per_tok=1))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    scores, logits = router(x)
    weights, ids = topk_sigmoid(logits, 1)
    assert torch.equal(ids[:, 0], scores.argmax(dim=-1))
    assert torch.equal(weights[:, 0], scores.max(dim=-1).values)

