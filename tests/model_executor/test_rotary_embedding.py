"""Rotary embeddings against transformers' own rope classes: cos / sin and rotated q / k for
every rope type (``LlamaRotaryEmbedding``), partial rotary in both layouts (Phi-3's halves,
GLM-4's interleaved pairs), per-layer-type parameters (Gemma 3), both config generations,
and one shared module per parameter set (``get_rope``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3TextConfig, Glm4Config, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.glm4 import modeling_glm4
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from pagedllm.arch_config import ROPE_TYPES, get_rope_parameters, model_context_len
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.rotary_embedding import _INV_FREQ, RotaryEmbedding, get_rope

HEAD_DIM = 16
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]

#: rope_scaling of each type (4.x form) with max_position_embeddings, and the context length vLLM derives.
ROPE_CASES = {
    "default": (None, 64, 64),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 64, 128),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 64, 192),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 64, 256),
    "yarn_mscale_untruncated": (
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
         "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5},
        128, 128,
    ),
    "yarn_attention_factor": (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48, "attention_factor": 1.3}, 96, 96,
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32},
        128, 128,
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        64, 64,
    ),
}  # fmt: skip


def _llama_config(rope_scaling, max_position_embeddings, rope_theta=10000.0) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=64,
        vocab_size=16, max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
    )  # fmt: skip


def _hf_cos_sin_one_at_a_time(hf_rope, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos / sin of each position, in a forward of its own and in increasing
    order: what its greedy decode steps compute."""
    x = torch.zeros(1, 1, HEAD_DIM)
    rows = [hf_rope(x, torch.tensor([[p]])) for p in range(num_positions)]
    return torch.cat([cos[0] for cos, _ in rows]), torch.cat([sin[0] for _, sin in rows])


def test_every_accepted_rope_type_is_built_and_tested():
    tested = {scaling.get("rope_type", scaling.get("type")) if scaling else "default" for scaling, _, _ in ROPE_CASES.values()}
    assert set(ROPE_TYPES) == set(_INV_FREQ) == tested


@pytest.mark.parametrize("case", ROPE_CASES)
def test_cos_sin_and_rotation_match_transformers(case):
    rope_scaling, max_position, context_len = ROPE_CASES[case]
    config = _llama_config(rope_scaling, max_position, rope_theta=500000.0 if "mscale" in case else 10000.0)
    assert model_context_len(config) == context_len
    rope = get_rope(HEAD_DIM, HEAD_DIM, max_position, get_rope_parameters(config))
    assert rope.cos_cache.shape == (context_len, HEAD_DIM)
    ref_cos, ref_sin = _hf_cos_sin_one_at_a_time(modeling_llama.LlamaRotaryEmbedding(config), context_len)
    positions = torch.arange(context_len)
    cos, sin = rope.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:, 0], ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin, rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(context_len, 4, HEAD_DIM, generator=gen), torch.randn(context_len, 2, HEAD_DIM, generator=gen)
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(q, k, ref_cos, ref_sin, unsqueeze_dim=1)
    out_q, out_k = rope.forward_native(q, k, cos, sin)
    torch.testing.assert_close(out_q, ref_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(out_k, ref_k, rtol=0, atol=1e-5)
    if cpu_kernels.is_available():
        kq, kk = rope.forward_cpu(q.clone(), k.clone(), cos, sin)
        torch.testing.assert_close(kq, ref_q, rtol=0, atol=1e-5)
        torch.testing.assert_close(kk, ref_k, rtol=0, atol=1e-5)


def test_4x_and_5_config_generations_give_the_same_parameters():
    rope_scaling, max_position, _ = ROPE_CASES["yarn"]
    v5 = _llama_config(rope_scaling, max_position, rope_theta=1e6)
    v4 = SimpleNamespace(rope_scaling={"type": "yarn", "factor": 4.0}, rope_theta=1e6, max_position_embeddings=64)
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    assert get_rope_parameters(v4) == expected
    assert get_rope_parameters(v5) == expected
    phi3 = SimpleNamespace(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                           original_max_position_embeddings=32, max_position_embeddings=128, partial_rotary_factor=0.5)
    assert get_rope_parameters(phi3) == {
        "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
    }  # fmt: skip


def _hf_rotated(module, rope_cls, config, q, k):
    """transformers' rotated q / k [T, H, D] (its layout [1, H, T, D] in and out)."""
    q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    cos, sin = getattr(module, rope_cls)(config)(q, torch.arange(q.shape[2])[None])
    return (t[0].transpose(0, 1) for t in module.apply_rotary_pos_emb(q, k, cos, sin))


@pytest.mark.parametrize(
    ("module", "rope_cls", "config_cls", "is_neox_style"),
    [(modeling_phi3, "Phi3RotaryEmbedding", Phi3Config, True), (modeling_glm4, "Glm4RotaryEmbedding", Glm4Config, False)],
    ids=["phi3_halves", "glm4_interleaved"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_transformers(module, rope_cls, config_cls, is_neox_style, dtype):
    config = config_cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                        num_hidden_layers=1, intermediate_size=64, vocab_size=16, max_position_embeddings=40,
                        partial_rotary_factor=0.5, rope_theta=10000.0)  # fmt: skip
    params = get_rope_parameters(config)
    rotary_dim = int(HEAD_DIM * params["partial_rotary_factor"])
    rope = get_rope(HEAD_DIM, rotary_dim, 40, params, is_neox_style=is_neox_style)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(40, 4, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(40, 2, HEAD_DIM, generator=gen).to(dtype)
    ref_q, ref_k = _hf_rotated(module, rope_cls, config, q, k)
    cos, sin = rope.cos_sin(torch.arange(40), dtype)
    for impl in (rope.forward_native, rope.forward_cpu) if cpu_kernels.is_available() else (rope.forward_native,):
        out_q, out_k = impl(q.clone(), k.clone(), cos, sin)
        # float32: PyTorch (and the kernel) may fuse multiply-adds; 16-bit: HF's roundings, bit-identical.
        tol = 1e-6 if dtype == torch.float32 else 0
        torch.testing.assert_close(out_q, ref_q, rtol=tol, atol=tol)
        torch.testing.assert_close(out_k, ref_k, rtol=tol, atol=tol)
        assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])


def test_per_layer_type_parameters_match_gemma3():
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                              num_hidden_layers=2, intermediate_size=64, vocab_size=16, max_position_embeddings=64,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6}})  # fmt: skip
    hf = Gemma3RotaryEmbedding(config)
    x, positions = torch.zeros(1, 1, HEAD_DIM), torch.arange(64)
    for layer_type in ("sliding_attention", "full_attention"):
        params = get_rope_parameters(config, layer_type)
        rope = get_rope(HEAD_DIM, HEAD_DIM, 64, params, num_positions=64)
        ref_cos, ref_sin = hf(x, positions[None], layer_type)
        cos, sin = rope.cos_sin(positions, torch.float32)
        torch.testing.assert_close(cos[:, 0], ref_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], ref_sin[0], rtol=0, atol=1e-6)
    assert model_context_len(config) == 64  # per-layer rope: max_position_embeddings is the scaled length
    with pytest.raises(ValueError, match="set per layer type .*layer_type=None"):
        get_rope_parameters(config)
    gemma3_4x = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None)
    assert get_rope_parameters(gemma3_4x, "sliding_attention") == {"rope_type": "default", "rope_theta": 10000.0}
    assert get_rope_parameters(gemma3_4x, "full_attention") == {"rope_type": "default", "rope_theta": 1e6}


def test_get_rope_shares_one_module_per_parameter_set():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    first = get_rope(HEAD_DIM, HEAD_DIM, 64, yarn)
    assert get_rope(HEAD_DIM, HEAD_DIM, 64, dict(yarn)) is first
    assert get_rope(HEAD_DIM, HEAD_DIM, 64, {**yarn, "factor": 2.0}) is not first
    assert get_rope(HEAD_DIM, 8, 64, yarn) is not first
    assert get_rope(HEAD_DIM, HEAD_DIM, 64, yarn, is_neox_style=False) is not first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rope_scaling": {"rope_type": "mrope"}}, "Unsupported rope_scaling type 'mrope'"),
        ({"rotary_dim": 7}, "rotary_dim must be even"),
        ({"rotary_dim": 32}, "rotary_dim must be even and in \\(0, head_dim=16\\]"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": LONG,
                           "original_max_position_embeddings": 32}}, "longrope factors have 1 entries.*needs 8"),
    ],
)  # fmt: skip
def test_bad_rope_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(HEAD_DIM, 64, 10000.0, **kwargs)
