"""``FusedMoE``'s routers against transformers' router modules on random logits, the grouped
expert compute against transformers' expert loop (and touching only the chosen experts at
batch 1), expert placement, the loading of expert tensors (both layouts, clear errors), and
the CPU layout each layer gets at load (the fused C++ kernel, or one GEMM plan per matrix)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, NemotronHConfig, Qwen2MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers import cpu_gemm
from pagedllm.model_executor.layers.fused_moe import cpu_fused
from pagedllm.model_executor.layers.fused_moe import FusedMoE, expert_range
from pagedllm.model_executor.layers.fused_moe.expert_groups import fused_experts, group_by_expert
from pagedllm.model_executor.layers.fused_moe.router import grouped_topk, select_experts, softmax_topk, topk_softmax
from tests.helpers import as_tensor_parallel_rank, cpu_only

HIDDEN, TOKENS = 32, 64


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weights, ids) in increasing id order (the order of the k choices is free)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _assert_same_routing(ours, theirs) -> None:
    (w, i), (w_ref, i_ref) = _by_expert(*ours), _by_expert(*theirs)
    assert torch.equal(i, i_ref.long())
    torch.testing.assert_close(w, w_ref.float(), rtol=1e-6, atol=1e-7)


def _randomized(router: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in list(router.parameters()) + list(router.buffers()):
            param.copy_(torch.randn(param.shape, generator=gen))
    return router


def _hidden(seed: int = 0) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_mixtral_router_softmax_topk_renormalised():
    router = _randomized(MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)), 1)
    logits, weights, ids = router(_hidden())
    _assert_same_routing(softmax_topk(logits, 2, renormalize=True), (weights, ids))
    _assert_same_routing(select_experts(logits, 2, renormalize=True), (weights, ids))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen_moe_router_with_and_without_renormalisation(norm_topk_prob):
    config = Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=12, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    logits, weights, ids = _randomized(Qwen2MoeTopKRouter(config), 2)(_hidden(1))
    ours = softmax_topk(logits, 4, renormalize=norm_topk_prob)
    _assert_same_routing(ours, (weights, ids))
    assert torch.allclose(ours[0].sum(-1), torch.ones(TOKENS)) == norm_topk_prob


def test_deepseek_v3_router_grouped_sigmoid_with_bias_and_scaling():
    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    router = _randomized(DeepseekV3TopkRouter(config), 3)
    logits, weights, ids = router(_hidden(2))
    ours = select_experts(logits, 4, renormalize=True, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                          scoring_func="sigmoid", e_score_correction_bias=router.e_score_correction_bias,
                          routed_scaling_factor=2.5)
    _assert_same_routing(ours, (weights, ids))
    # The bias moves the choice: without it other experts win for some tokens.
    unbiased = grouped_topk(logits, 4, True, 4, 2, "sigmoid", None, 2.5)
    assert not torch.equal(_by_expert(*unbiased)[1], _by_expert(*ours)[1])


@pytest.mark.parametrize(("topk_method", "n_group", "topk_group"), [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_deepseek_v2_router_softmax_groups_scored_by_their_best(topk_method, n_group, topk_group):
    config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                              topk_group=topk_group, topk_method=topk_method, routed_scaling_factor=16.0)
    logits, weights, ids = _randomized(DeepseekV2TopkRouter(config), 5)(_hidden(4))
    ours = select_experts(logits, 4, renormalize=False, use_grouped_topk=True, num_expert_group=n_group,
                          topk_group=topk_group, scoring_func="softmax", routed_scaling_factor=16.0)
    _assert_same_routing(ours, (weights, ids))


def test_gpt_oss_router_softmax_over_the_chosen():
    config = GptOssConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=4)
    logits, weights, ids = _randomized(GptOssTopKRouter(config), 4)(_hidden(3))
    ours = select_experts(logits, 4, renormalize=False, custom_routing_function=topk_softmax)
    _assert_same_routing(ours, (weights, ids))


def test_router_errors():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="top_k 9 must be between 1 and the number of experts 8"):
        softmax_topk(logits, 9, True)
    with pytest.raises(ValueError, match="num_expert_group 3 does not divide the 8 experts"):
        grouped_topk(logits, 2, True, 3, 1)
    with pytest.raises(ValueError, match="needs grouped top-k routing"):
        select_experts(logits, 2, True, scoring_func="sigmoid")


def _reference_experts(num_experts=8, inter=16, seed=5) -> MixtralExperts:
    """transformers' ``MixtralExperts`` with random weights."""
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=inter, num_local_experts=num_experts)
    return _randomized(MixtralExperts(config), seed)


def _loaded_layer(ref: MixtralExperts, **kwargs) -> FusedMoE:
    """A ``FusedMoE`` (this process's rank's part) loaded with ``ref``'s experts, one at a time."""
    num_experts, inter = ref.gate_up_proj.shape[0], ref.gate_up_proj.shape[1] // 2
    layer = FusedMoE(num_experts, 2, HIDDEN, inter, prefix="experts", **kwargs)
    for e in range(num_experts):
        gate, up = ref.gate_up_proj[e].chunk(2)
        for shard, w in (("w1", gate), ("w3", up), ("w2", ref.down_proj[e])):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, w, f"experts.{e}.{shard}", shard, e)
    assert layer.missing_weights() == []
    return layer


def _experts_pair(num_experts=8, inter=16, seed=5):
    """transformers' ``MixtralExperts`` with random weights, and a ``FusedMoE`` holding the same."""
    ref = _reference_experts(num_experts, inter, seed)
    return ref, _loaded_layer(ref)


def test_fused_moe_equals_transformers_expert_loop():
    ref, layer = _experts_pair()
    x = _hidden(4)
    weights, ids = softmax_topk(torch.randn(TOKENS, 8, generator=torch.Generator().manual_seed(9)), 2, True)
    with torch.inference_mode():
        torch.testing.assert_close(layer.quant_method.apply(layer, x, weights, ids), ref(x, ids, weights),
                                   rtol=1e-6, atol=1e-6)


def test_ungated_relu2_experts_equal_transformers_expert_loop():
    """Nemotron-H's experts (down(relu(up x) ** 2), no gate), loaded from transformers' stacked
    ``up_proj`` / ``down_proj``; an up ("w3") matrix has no place in them."""
    config = NemotronHConfig(hidden_size=HIDDEN, n_routed_experts=8, moe_intermediate_size=16)
    ref = _randomized(NemotronHExperts(config), 6)
    layer = FusedMoE(8, 2, HIDDEN, 16, prefix="experts", activation="relu2_no_mul")
    layer.load_stacked_experts("experts.up_proj", ref.up_proj.data, "up_proj")
    layer.load_stacked_experts("experts.down_proj", ref.down_proj.data, "down_proj")
    assert layer.missing_weights() == [] and layer.w13_weight.shape == (8, 16, HIDDEN)
    x = _hidden(5)
    weights, ids = softmax_topk(torch.randn(TOKENS, 8, generator=torch.Generator().manual_seed(10)), 2, True)
    with torch.inference_mode():
        # float32 rounding grows with relu2's squares (outputs of order 10)
        torch.testing.assert_close(layer.quant_method.apply(layer, x, weights, ids), ref(x, ids, weights),
                                   rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="unknown expert shard id 'w3'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(16, HIDDEN), "experts.0.w3", "w3", 0)
    with pytest.raises(ValueError, match="stacked expert tensor 'gate_up_proj' for ungated experts"):
        layer.load_stacked_experts("experts.gate_up_proj", torch.zeros(8, 32, HIDDEN), "gate_up_proj")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_partial_sums_equal_the_whole(monkeypatch, expert_parallel):
    """Tensor parallelism (each rank half of every expert's I) and expert parallelism (5
    experts: 3 on rank 0, 2 on rank 1): the ranks' outputs add up to transformers'."""
    ref = _reference_experts(num_experts=5, seed=6)
    x = _hidden(5)
    weights, ids = softmax_topk(torch.randn(TOKENS, 5, generator=torch.Generator().manual_seed(10)), 2, True)
    partials = []
    for rank in range(2):
        as_tensor_parallel_rank(monkeypatch, rank, 2)
        layer = _loaded_layer(ref, enable_expert_parallel=expert_parallel)
        assert (layer.local_num_experts, layer.intermediate_size_per_partition) == (
            ((3, 2)[rank], 16) if expert_parallel else (5, 8))
        with torch.inference_mode():
            partials.append(layer.quant_method.apply(layer, x, weights, ids))
    with torch.inference_mode():
        torch.testing.assert_close(partials[0] + partials[1], ref(x, ids, weights), rtol=1e-5, atol=1e-5)


def test_one_token_touches_only_its_experts():
    weights, ids = torch.tensor([[0.7, 0.3]]), torch.tensor([[5, 2]])
    groups = group_by_expert(weights, ids, 8)
    assert groups.counts == [0, 0, 1, 0, 0, 1, 0, 0]
    touched = []
    out = fused_experts(torch.ones(1, 4), groups, lambda e, rows: touched.append(e) or rows * (e + 1))
    assert touched == [2, 5]
    assert torch.allclose(out, torch.full((1, 4), 0.7 * 6 + 0.3 * 3))


def test_grouping_drops_experts_held_elsewhere():
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]])
    expert_map = torch.tensor([-1, -1, 0, 1])  # this rank holds experts 2 and 3
    groups = group_by_expert(torch.rand(3, 2), ids, 2, expert_map)
    assert groups.counts == [1, 2]
    assert groups.token_rows.tolist() == [1, 0, 2]


@pytest.mark.parametrize(("num_experts", "ranks", "expected"),
                         [(8, 2, [(0, 4), (4, 4)]), (5, 2, [(0, 3), (3, 2)]), (7, 3, [(0, 3), (3, 2), (5, 2)])])
def test_expert_range_contiguous(num_experts, ranks, expected):
    assert [expert_range(num_experts, ranks, r) for r in range(ranks)] == expected


def test_weight_loader_errors():
    _, layer = _experts_pair(num_experts=4)
    with pytest.raises(ValueError, match="expert 4 does not exist"):
        layer.weight_loader(layer.w2_weight, torch.zeros(HIDDEN, 16), "experts.4.w2", "w2", 4)
    with pytest.raises(ValueError, match=r"'experts.0.w1'.*shape \(8, 32\)"):
        layer.weight_loader(layer.w13_weight, torch.zeros(8, HIDDEN), "experts.0.w1", "w1", 0)
    with pytest.raises(ValueError, match="unknown expert shard id 'w4'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(16, HIDDEN), "experts.0.w4", "w4", 0)


def test_debug_log_counts_tokens_per_expert(monkeypatch):
    _, layer = _experts_pair(num_experts=4)
    logits = torch.tensor([[9.0, 0, 8, 0], [9, 0, 0, 8], [0, 9, 8, 0]])
    logger = logging.getLogger("pagedllm.model_executor.layers.fused_moe.layer")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logger, "handlers", [handler])
    level = logger.level
    try:
        with torch.inference_mode():
            logger.setLevel(logging.INFO)
            layer(_hidden()[:3], logits)
            logger.setLevel(logging.DEBUG)
            layer(_hidden()[:3], logits)
    finally:
        logger.setLevel(level)
    assert [r.getMessage() for r in records] == ["experts: 3 tokens; tokens per expert [2, 1, 2, 1]"]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_run_on_the_fused_kernel_where_it_is_built(dtype):
    """With the C++ kernels, loaded experts are packed for the fused kernel (no stacked or
    per-expert matrices left); the output is transformers' experts in float64 to one rounding
    of the output (bf16) or float32 summation error, as close as torch's matmuls on the
    stacked weights were (which round bf16 intermediates too)."""
    ref = _reference_experts(num_experts=4)
    with torch.no_grad():
        ref.gate_up_proj.copy_(ref.gate_up_proj.to(dtype))
        ref.down_proj.copy_(ref.down_proj.to(dtype))
    layer = _loaded_layer(ref, params_dtype=dtype)
    x = _hidden(6).to(dtype)
    weights, ids = softmax_topk(torch.randn(TOKENS, 4, generator=torch.Generator().manual_seed(11)), 2, True)
    with torch.inference_mode():
        stacked = layer.quant_method.apply(layer, x, weights, ids)
        fused = cpu_fused.can_fuse(layer)
        assert fused == cpu_kernels.is_available()
        layer.quant_method.process_weights_after_loading(layer)
        layer.quant_method.process_weights_after_loading(layer)  # a second call changes nothing
        assert hasattr(layer, "w13_packed") == fused and hasattr(layer, "w13_weight") != fused
        assert not hasattr(layer, "w13_experts")
        if fused:
            assert layer.w13_packed.shape == (4, 2, HIDDEN, 16) and layer.w2_packed.shape == (4, 2, 16, 16)
            assert layer.quant_method.describe_path(layer).startswith("experts: fused C++ kernel")
        got = layer.quant_method.apply(layer, x, weights, ids)
        exact = ref.double()(x.double(), ids, weights.double())
        scale = float(exact.abs().max())
        tol = torch.finfo(dtype).eps * scale if dtype == torch.bfloat16 else 1e-6 * scale
        assert float((got.double() - exact).abs().max()) <= tol
        assert float((got.double() - exact).abs().max()) <= float((stacked.double() - exact).abs().max()) + tol / 2


@cpu_only
def test_clamped_swiglu_bfloat16_experts_get_one_widening_plan_per_matrix_where_needed():
    """gpt-oss's "swigluoai" is not fused: on a CPU without native bf16 matmuls each expert
    matrix gets ``linear_w16``; the output stays that of torch's matmul on the stacked weights
    (to bf16 rounding)."""
    ref = _reference_experts(num_experts=4)
    with torch.no_grad():
        ref.gate_up_proj.copy_(ref.gate_up_proj.bfloat16())
        ref.down_proj.copy_(ref.down_proj.bfloat16())
    layer = _loaded_layer(ref, params_dtype=torch.bfloat16, activation="swigluoai")
    x = _hidden(6).bfloat16()
    weights, ids = softmax_topk(torch.randn(TOKENS, 4, generator=torch.Generator().manual_seed(11)), 2, True)
    with torch.inference_mode():
        stacked = layer.quant_method.apply(layer, x, weights, ids)
        assert not cpu_fused.can_fuse(layer)
        widen = cpu_gemm.should_widen(layer.w13_weight.data[0])
        layer.quant_method.process_weights_after_loading(layer)
        assert hasattr(layer, "w13_experts") == widen and hasattr(layer, "w13_weight") != widen
        if widen:
            assert all(isinstance(m.gemm_plan, cpu_gemm.WidenedGemm) for m in [*layer.w13_experts, *layer.w2_experts])
        torch.testing.assert_close(layer.quant_method.apply(layer, x, weights, ids), stacked, rtol=2e-2, atol=2e-2)
