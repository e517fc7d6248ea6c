"""Qwen3-Next and Qwen3.5: the Gated DeltaNet layer equal to transformers' ``Qwen3NextGatedDeltaNet``
/ ``Qwen3_5GatedDeltaNet`` (float32, random weights) over ragged prefills, decode steps with the
carried conv and recurrent states, and a batch mixing both; the models greedy token-identical to
transformers (float32) on the engine, its state cache holding the linear-attention states, under
chunked prefill (prompts to 200 tokens), preemption and prefix caching, each run ending with the
block-accounting check."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from pagedllm.model_executor.layers.gated_deltanet import GatedDeltaNet
from pagedllm.model_executor.layers.mamba.abstract import MambaMetadata
from pagedllm.model_executor.models.qwen3_5 import Qwen3_5LinearAttention
from pagedllm.model_executor.utils import default_weight_loader
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

LAYER_CONFIG = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                    layer_types=["linear_attention"], rms_norm_eps=1e-6)


#: (transformers' config and layer, ours) of each layout of the projections.
LAYOUTS = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet, GatedDeltaNet),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, Qwen3_5LinearAttention),
}


def _layers(layout: str) -> tuple[torch.nn.Module, GatedDeltaNet]:
    """transformers' layer with random weights (norm weights away from 1, dt_bias and A_log
    spread) and ours holding the same tensors."""
    config_cls, reference_cls, ours_cls = LAYOUTS[layout]
    config = config_cls(**LAYER_CONFIG)
    torch.manual_seed(0)
    reference = reference_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(torch.randn_like(param) * (0.5 if name in ("dt_bias", "A_log") else 0.2)
                        + (1.0 if name == "norm.weight" else 0.0))
    ours = ours_cls(config, None, "linear_attn")
    params = dict(ours.named_parameters())
    for name, tensor in reference.state_dict().items():
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)
    assert set(params) == set(reference.state_dict())
    return reference, ours


def _step(layer, x, states, slots, lengths, initial, num_decodes):
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    metadata = MambaMetadata(bounds, torch.tensor(slots, dtype=torch.int32), torch.tensor(initial), num_decodes,
                             len(slots) - num_decodes, int(bounds[-1] - bounds[num_decodes]))
    return layer.mix(x, *states, metadata)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gated_deltanet_equals_transformers_over_prefill_and_decode(layout):
    reference, ours = _layers(layout)
    torch.manual_seed(1)
    # Requests A (70-token prompt, past a 64-token block) and B (5 tokens, under the conv width
    # plus one) prefill together; then C (20 tokens) prefills beside A's and B's decodes; then
    # all three decode.
    prompts, steps = {"A": 70, "B": 5, "C": 20}, 4
    seqs = {name: torch.randn(n + steps, 64) for name, n in prompts.items()}
    with torch.no_grad():
        want = {name: reference(x.unsqueeze(0))[0] for name, x in seqs.items()}
    slot = {"A": 2, "B": 0, "C": 3}
    # Stale slots (a finished request's state): must not be read by a request starting afresh.
    conv_state, ssm_state = (torch.full((4, *shape), 1e3) for shape in ours.get_state_shape())
    states, done = (conv_state, ssm_state), {"A": 0, "B": 0, "C": 0}

    def run(decodes, prefills):
        names = decodes + prefills
        lengths = [1] * len(decodes) + [prompts[n] for n in prefills]
        x = torch.cat([seqs[n][done[n]:done[n] + length] for n, length in zip(names, lengths)])
        with torch.no_grad():
            out = _step(ours, x, states, [slot[n] for n in names], lengths, [done[n] > 0 for n in names],
                        len(decodes))
        for n, chunk in zip(names, out.split(lengths)):
            torch.testing.assert_close(chunk, want[n][done[n]:done[n] + len(chunk)], atol=1e-5, rtol=1e-5)
            done[n] += len(chunk)

    run([], ["A", "B"])
    run(["A", "B"], ["C"])
    for _ in range(steps - 1):
        run(["A", "B", "C"], [])
    assert done == {"A": 70 + steps, "B": 5 + steps, "C": 20 + 3}
    assert (ssm_state[1] == 1e3).all() and (conv_state[1] == 1e3).all()  # no request's slot: untouched


#: Four layers (three Gated DeltaNet, then gated attention, by the default full_attention_interval 4),
#: experts with a gated shared expert on all but a dense layer, grouped value heads.
CONFIG = dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, intermediate_size=64, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, mlp_only_layers=[1])
#: Up to 200 tokens: past the 64-token blocks of the chunked delta rule, cut by 16-token steps.
PROMPT_LENGTHS = (3, 17, 45, 90, 200)


@pytest.fixture(scope="module")
def qwen3_next(checkpoint_factory):
    return checkpoint_factory("Qwen3NextForCausalLM", seed=3, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(qwen3_next, scenario):
    """Chunked prefill: 16-token steps cut the prompts (to 200 tokens) mid-way, the state carried
    from chunk to chunk, decodes beside prefill chunks in one batch. Preemption: a preempted
    request gives back its blocks and state slot and recomputes its state. Prefix caching: hits
    start from a saved state."""
    lengths = PROMPT_LENGTHS if scenario == "chunked_prefill" else (3, 17, 45, 90)
    assert_scenario(qwen3_next, scenario, prompts_for(1024, lengths=lengths))


#: Qwen3.5's linear-attention shapes, as CONFIG's.
QWEN3_5_CONFIG = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=8)


def test_qwen3_5_moe_greedy_equals_transformers(checkpoint_factory):
    """Qwen3.5-MoE: Qwen3.5's projections (``Qwen3_5LinearAttention``) and experts on every layer.
    (Dense Qwen3.5 differs from it by the MLP alone, Qwen3-Next's dense layer above.)"""
    path = checkpoint_factory("Qwen3_5MoeForCausalLM", seed=4, **QWEN3_5_CONFIG, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32)
    assert_scenario(path, "chunked_prefill", prompts_for(1024, lengths=(3, 17, 70)))
