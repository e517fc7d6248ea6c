"""Nemotron-H (one mixer per layer by ``hybrid_override_pattern``: Mamba-2 on the state cache,
attention without rope on the paged KV cache, a relu2 MLP and routed relu2 experts that keep
no cache): greedy output token-identical to transformers float32 with prompts cut into chunks
mid-way beside decodes, and under preemption (a preempted request gives back its blocks and its
state slot); with "E" layers (sigmoid router with a score correction bias, grouped top-k, scaled
and renormalised weights, a shared expert) under chunked prefill; an "E" block with latent
projections (``moe_latent_size``) equal to transformers' on random weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.utils import assert_scenario, prompts_for

PROMPT_LENGTHS, MAX_TOKENS = (20, 45, 90), 8
#: Fewer sequences: the state slots of three mixer layers fit the test cache.
ENGINE = {"max_num_seqs": 16}


@pytest.fixture(scope="module")
def nemotron_h(checkpoint_factory):
    return checkpoint_factory(
        "NemotronHForCausalLM", seed=8, hybrid_override_pattern="M*-M", head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, intermediate_size=128)


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_nemotron_h_greedy_matches_transformers(nemotron_h, scenario, tokenizer):
    engine = ENGINE if scenario == "chunked_prefill" else {}
    assert_scenario(nemotron_h, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS, **engine)


@pytest.fixture(scope="module")
def nemotron_h_moe(checkpoint_factory):
    """M, E, *, - and E layers; 8 experts in 4 groups (2 kept), 2 per token. transformers writes
    the routers' ``e_score_correction_bias`` as zeros: set to random values here, so the bias
    changes which experts are chosen."""
    path = checkpoint_factory(
        "NemotronHForCausalLM", seed=9, hybrid_override_pattern="ME*-E", head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, intermediate_size=128,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(9)
    for name in sorted(weights):
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.randn(weights[name].shape, generator=generator) * 0.3
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_nemotron_h_moe_greedy_matches_transformers(nemotron_h_moe, tokenizer):
    assert_scenario(nemotron_h_moe, "chunked_prefill", prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS,
                    **ENGINE)


def test_nemotron_h_latent_moe_block_matches_transformers():
    """An "E" block with ``moe_latent_size`` (experts between fc1 / fc2 latent projections) on
    random weights, biased router included, equals transformers' ``NemotronHMoE``."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE as HFNemotronHMoE

    from pagedllm.model_executor.models.nemotron_h import NemotronHMoE

    config = NemotronHConfig(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                             moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=24,
                             routed_scaling_factor=2.5, norm_topk_prob=True, mlp_bias=True)
    generator = torch.Generator().manual_seed(3)
    reference = HFNemotronHMoE(config).eval()
    with torch.no_grad():
        for tensor in [*reference.parameters(), *reference.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5)
    ours = NemotronHMoE(config, None, "mixer")
    params = dict(ours.named_parameters())
    for name, tensor in reference.state_dict().items():
        if name.startswith("experts."):
            ours.experts.load_stacked_experts(name, tensor, name.removeprefix("experts."))
        else:
            getattr(params[name], "weight_loader", lambda p, t: p.data.copy_(t))(params[name], tensor)
    x = torch.randn(40, 64, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(ours((), x), reference(x[None])[0], rtol=1e-5, atol=1e-5)
