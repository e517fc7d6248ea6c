"""The quantization seam: a ``QuantizationConfig`` picks each linear layer's and the lm_head's
method by name, the layers create, prepare and apply their weights only through it, the
model loader prepares every one after loading, and formats are found by name (an unknown
one is refused with the supported ones listed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from transformers import AutoConfig

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.selector import set_attn_backend
from pagedllm.model_executor import model_loader
from pagedllm.model_executor.layers import quantization
from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization import QuantizationConfig, get_quantization_config
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedConfig
from pagedllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from pagedllm.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM


class RecordingMethod(UnquantizedLinearMethod):
    """The unquantized method, recording (call, layer name) for every call."""

    def __init__(self, calls: list, prefix: str) -> None:
        self.calls, self.prefix = calls, prefix

    def create_weights(self, layer, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("create", self.prefix))
        super().create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer) -> None:
        self.calls.append(("process", self.prefix))
        super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        self.calls.append(("apply", self.prefix))
        return super().apply(layer, x, bias)


class RecordingConfig(QuantizationConfig):
    def __init__(self) -> None:
        self.calls: list = []

    @classmethod
    def get_name(cls) -> str:
        return "recording"

    @classmethod
    def from_config(cls, config: dict) -> "RecordingConfig":
        return cls()

    def get_quant_method(self, layer, prefix: str) -> Optional[RecordingMethod]:
        return RecordingMethod(self.calls, prefix)


LINEAR_NAMES = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]


def _load(model_cls, path, quant_config=None):
    with set_attn_backend(TorchSDPABackend):
        model = model_cls(AutoConfig.from_pretrained(path), quant_config)
    model.load_weights(model_loader.iterate_weights(path))
    model_loader.process_weights_after_loading(model)
    return model


@pytest.mark.parametrize("arch, model_cls", [("tiny_llama", LlamaForCausalLM), ("tiny_qwen2", Qwen2ForCausalLM)])
def test_every_linear_layer_and_the_lm_head_use_the_configs_method(arch, model_cls, request):
    """tiny_qwen2 has tied embeddings: its lm_head's method applies the embedding table."""
    path = request.getfixturevalue(arch)
    config = RecordingConfig()
    model = _load(model_cls, path, config)
    names = [f"model.layers.{i}.{name}" for i in range(2) for name in LINEAR_NAMES] + ["lm_head"]
    assert [c for c in config.calls if c[0] == "create"] == [("create", n) for n in names]
    assert sorted(c for c in config.calls if c[0] == "process") == sorted(("process", n) for n in names)
    reference = _load(model_cls, path)
    assert isinstance(reference.lm_head.quant_method, UnquantizedEmbeddingMethod)
    modules, reference_modules = dict(model.named_modules()), dict(reference.named_modules())
    config.calls.clear()
    torch.manual_seed(0)
    with torch.inference_mode():
        for name in names[:-1]:
            layer, plain = modules[name], reference_modules[name]
            assert isinstance(layer.quant_method, RecordingMethod)
            assert isinstance(plain.quant_method, UnquantizedLinearMethod)
            x = torch.randn(3, layer.input_size_per_partition)
            assert torch.equal(layer(x), plain(x))
        hidden = torch.randn(3, model.config.hidden_size)
        assert torch.equal(model.compute_logits(hidden), reference.compute_logits(hidden))
    assert config.calls == [("apply", n) for n in names]


def test_registry_by_name():
    assert get_quantization_config(None) is UnquantizedConfig
    assert get_quantization_config("unquantized") is UnquantizedConfig
    assert UnquantizedConfig.from_config({}).get_quant_method(object(), "lm_head") is None
    with pytest.raises(ValueError, match="Quantization method 'bitsandbytes' is not supported yet. Supported: awq, "):
        get_quantization_config("bitsandbytes")


def _model_config(quantization_config) -> SimpleNamespace:
    return SimpleNamespace(
        hf_config=SimpleNamespace(quantization_config=quantization_config), quantization=None,
        quantization_config=None, model_path=Path("m"),
    )


def test_the_loader_reads_config_jsons_quantization_config(monkeypatch):
    no_format = SimpleNamespace(hf_config=SimpleNamespace(), quantization=None, quantization_config=None, model_path=Path("m"))
    assert model_loader.get_quant_config(no_format) is None
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        model_loader.get_quant_config(_model_config({"quant_method": "bitsandbytes", "bits": 4}))
    monkeypatch.setitem(quantization.QUANTIZATION_METHODS, "recording", RecordingConfig)
    assert isinstance(model_loader.get_quant_config(_model_config({"quant_method": "recording"})), RecordingConfig)
    quantized = _model_config({"quant_method": "recording"})
    quantized.quantization_config = {"group_size": 128}
    with pytest.raises(ValueError, match="--quantization-config configures a format quantized at load .* already quantized as 'recording'"):
        model_loader.get_quant_config(quantized)
