"""The Qwen-VL vision towers' patch embedding (``PatchEmbedding``, a matmul over the flattened
patches) against torch's ``nn.Conv3d`` of kernel == stride on random patches, at Qwen2.5-VL's
and Qwen3-VL's shapes, with and without a bias: float32 within 1e-5, bfloat16 within its
rounding; and the towers' ``patch_embed.proj.*`` names and shapes are transformers' (its
state dict loads as it is and gives transformers' patch embedding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.model_executor.models.qwen2_5_vl import PatchEmbedding, Qwen2_5_VisionTransformer
from pagedllm.model_executor.models.qwen3_vl import Qwen3VLVisionModel

#: (in_channels, embedding width, temporal patch, patch): Qwen2.5-VL-3B's and Qwen3-VL-2B's.
SHAPES = {"qwen2.5-vl": (3, 1280, 2, 14), "qwen3-vl": (3, 1024, 2, 16)}
NUM_PATCHES = 96


def _conv_and_ours(shape: tuple, bias: bool, dtype: torch.dtype) -> tuple[nn.Conv3d, PatchEmbedding]:
    channels, width, temporal, patch = shape
    kernel = (temporal, patch, patch)
    torch.manual_seed(0)
    conv = nn.Conv3d(channels, width, kernel, stride=kernel, bias=bias)
    if bias:
        nn.init.normal_(conv.bias, std=0.5)
    ours = PatchEmbedding(channels, width, kernel, bias)
    ours.load_state_dict(conv.state_dict())
    return conv.to(dtype), ours.to(dtype)


def _patches(shape: tuple) -> torch.Tensor:
    channels, _, temporal, patch = shape
    return torch.randn(NUM_PATCHES, channels * temporal * patch * patch, generator=torch.Generator().manual_seed(1))


def _conv_out(conv: nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    return conv(patches.to(conv.weight.dtype).view(-1, conv.in_channels, *conv.kernel_size)).view(patches.shape[0], -1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_patch_embedding_equals_conv3d_float32(model, bias):
    conv, ours = _conv_and_ours(SHAPES[model], bias, torch.float32)
    patches = _patches(SHAPES[model])
    with torch.no_grad():
        out, expected = ours(patches), _conv_out(conv, patches)
    assert out.dtype == torch.float32 and out.shape == (NUM_PATCHES, SHAPES[model][1])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_patch_embedding_equals_conv3d_bfloat16(model, bias):
    conv, ours = _conv_and_ours(SHAPES[model], bias, torch.bfloat16)
    patches = _patches(SHAPES[model])  # float32: cast to the weights' dtype inside
    with torch.no_grad():
        out, expected = ours(patches), _conv_out(conv, patches)
        exact = _conv_out(conv.float(), patches.to(torch.bfloat16).float())  # the bfloat16 operands' exact sums
    assert out.dtype == torch.bfloat16
    # Each within about one bfloat16 rounding (relative 2^-8, one ulp at most) of the exact sums,
    # so within two roundings of the convolution's bfloat16 output.
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-4)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2e-4)


def _transformers_vision(model: str):
    if model == "qwen2.5-vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Model,
        )
        extra = dict(window_size=56, fullatt_block_indexes=[0], out_hidden_size=64)
        ours_cls = Qwen2_5_VisionTransformer
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Model
        extra = dict(num_position_embeddings=16, deepstack_visual_indexes=[], out_hidden_size=64)
        ours_cls = Qwen3VLVisionModel
    channels, _, temporal, patch = SHAPES[model]
    config = Config(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, in_channels=channels,
                    patch_size=patch, temporal_patch_size=temporal, spatial_merge_size=2, **extra)
    return Model._from_config(config), ours_cls(config)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_patch_embedding_loads_transformers_state_dict(model):
    theirs, ours = _transformers_vision(model)
    expected = {k: v for k, v in theirs.state_dict().items() if k.startswith("patch_embed.")}
    got = {k: v for k, v in ours.state_dict().items() if k.startswith("patch_embed.")}
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in expected.items()}
    ours.patch_embed.load_state_dict({k[len("patch_embed."):]: v for k, v in expected.items()})
    patches = _patches(SHAPES[model])
    with torch.no_grad():
        torch.testing.assert_close(ours.embed_patches(patches), theirs.patch_embed(patches), rtol=0, atol=1e-5)
