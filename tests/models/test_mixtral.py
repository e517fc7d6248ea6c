"""Mixtral: greedy token-identical to transformers (float32) under chunked prefill, preemption
and prefix caching; both expert layouts load (the Hub's per-expert tensors, transformers'
stacked ones); a missing, extra or mis-shaped expert tensor is refused by name; a pipeline
stage loads its own layers' experts only."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.selector import set_attn_backend
from pagedllm.model_executor.models.mixtral import MixtralForCausalLM
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

CONFIG = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2)


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("MixtralForCausalLM", seed=3, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(mixtral, scenario):
    assert_scenario(mixtral, scenario, prompts_for(1024))


def _model_and_weights(path):
    with set_attn_backend(TorchSDPABackend):
        model = MixtralForCausalLM(AutoConfig.from_pretrained(path))
    return model, load_file(path / "model.safetensors")


def test_stacked_expert_layout_loads_the_same(mixtral):
    model, weights = _model_and_weights(mixtral)
    model.load_weights(weights.items())
    stacked, prefix = dict(weights), "model.layers.{}.block_sparse_moe.experts"
    for layer in range(2):
        experts = prefix.format(layer)
        per_expert = [[stacked.pop(f"{experts}.{e}.{w}.weight") for w in ("w1", "w3", "w2")] for e in range(8)]
        stacked[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([w1, w3]) for w1, w3, _ in per_expert])
        stacked[f"{experts}.down_proj"] = torch.stack([w2 for _, _, w2 in per_expert])
    other, _ = _model_and_weights(mixtral)
    loaded = other.load_weights(stacked.items())
    assert {"model.layers.0.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"} <= loaded
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("edit", "message"), [
    ("drop", r"lacks expert weights of model.layers.1.mlp.experts: expert 3 w2"),
    ("extra", r"expert 8 does not exist \(the layer has 8\)"),
    ("unknown", r"'w4' is not an expert matrix of MixtralForCausalLM"),
    ("shape", r"Checkpoint tensor 'model.layers.0.mlp.experts.2.w1.weight' has shape|dimension 0 should be 32"),
])
def test_bad_expert_tensors_are_refused(mixtral, edit, message):
    model, weights = _model_and_weights(mixtral)
    name = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    if edit == "drop":
        del weights[name.format(1, 3, "w2")]
    elif edit == "extra":
        weights[name.format(0, 8, "w1")] = weights[name.format(0, 0, "w1")]
    elif edit == "unknown":
        weights[name.format(0, 0, "w4")] = weights[name.format(0, 0, "w1")]
    else:
        weights[name.format(0, 2, "w1")] = weights[name.format(0, 2, "w1")][:16]
    with pytest.raises(ValueError, match=message):
        model.load_weights(weights.items())


def test_a_pipeline_stage_loads_only_its_experts(mixtral, monkeypatch):
    from pagedllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_pp_group", parallel_state.GroupCoordinator([0, 1], 1))  # the last stage
    model, weights = _model_and_weights(mixtral)
    loaded = model.load_weights(weights.items())
    assert "model.layers.1.mlp.experts.w13_weight" in loaded
    assert not any(name.startswith("model.layers.0.") for name in loaded)
