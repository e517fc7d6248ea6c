"""Build a model and load its weights from a Hugging Face directory (safetensors)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.arch_config import check_hf_config
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.selector import set_attn_backend
from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.batch_invariant import use_batch_invariant_methods
from pagedllm.model_executor.layers.cpu_gemm import pack_weight
from pagedllm.model_executor.layers.rotary_embedding import rope_cache_scope
from pagedllm.model_executor.gguf_weights import KERNEL_TYPES, iterate_gguf_weights, open_gguf, tensor_types
from pagedllm.model_executor.layers.quantization import (
    ONLINE_QUANTIZATION_METHODS,
    QuantizationConfig,
    get_quantization_config,
)
from pagedllm.model_executor.layers.quantization.gguf import GGUFConfig
from pagedllm.model_executor.models.adapters import as_seq_cls_model, classifier_token_ids
from pagedllm.model_executor.models.registry import get_model_class
from pagedllm.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


def safetensors_files(model_path: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files: from ``model.safetensors.index.json`` when
    present (sharded), else every ``*.safetensors`` file in the directory.

    Raises:
        ValueError: if there are none.
    """
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_path}; pagedllm loads safetensors checkpoints only.")
    return files


def iterate_weights(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one file at a time."""
    for path in safetensors_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def get_quant_config(model_config: ModelConfig) -> Optional[QuantizationConfig]:
    """The weight format: config.json's ``quantization_config`` ("gguf" for a GGUF file, with
    the linear modules it holds in types the kernels run), or ``--quantization``'s format applied at
    load time to an unquantized checkpoint, with ``--quantization-config``'s options (None: neither).

    Raises:
        ValueError: for a format pagedllm does not support (the message lists those it
            does), a ``--quantization`` that differs from the checkpoint's format, a
            checkpoint format asked of an unquantized checkpoint, or ``--quantization-config``
            keys the format does not read (or given without a format that quantizes at load).
    """
    config = getattr(model_config.hf_config, "quantization_config", None)
    requested, options = model_config.quantization, model_config.quantization_config
    online = "|".join(ONLINE_QUANTIZATION_METHODS)
    if model_config.model_path.suffix == ".gguf":
        reader = open_gguf(model_config.model_path)
        types = tensor_types(reader, model_config.hf_config)
        layouts = {name.removesuffix(".weight"): KERNEL_TYPES[kind] for name, kind in types.items() if kind in KERNEL_TYPES}
        config = {"quant_method": "gguf", "module_layouts": layouts}
    if config is None:
        if requested is None:
            if options:
                raise ValueError(f"--quantization-config needs --quantization {online}, the format it configures.")
            return None
        method_class = get_quantization_config(requested)
        if requested not in ONLINE_QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization {requested} needs a checkpoint quantized as {requested} (config.json has no "
                f"quantization_config); the methods that quantize at load are {', '.join(ONLINE_QUANTIZATION_METHODS)}."
            )
        unknown = sorted(set(options or {}) - set(method_class.online_config_keys))
        if unknown:
            raise ValueError(
                f"--quantization-config: --quantization {requested} does not read {', '.join(unknown)}; it reads "
                f"{', '.join(method_class.online_config_keys) or 'no keys'}."
            )
        return method_class.from_config(dict(options or {}))
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if options:
        raise ValueError(
            f"--quantization-config configures a format quantized at load (--quantization {online}); this "
            f"checkpoint is already quantized as {method!r}."
        )
    if requested is not None and requested != method:
        raise ValueError(
            f"--quantization {requested} does not match the checkpoint, which is quantized as {method!r} "
            f"(config.json's quantization_config); leave --quantization out to use the checkpoint's format."
        )
    return get_quantization_config(method).from_config(config)


def process_weights_after_loading(model: nn.Module) -> Counter[str]:
    """Let every layer's ``quant_method`` prepare its loaded weights (re-layouts for this
    machine's matmul ...); returns how many layers take each matmul path
    (``describe_path``), for the start-up log."""
    paths: Counter[str] = Counter()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
            paths[method.describe_path(module)] += 1
    return paths


def get_model(model_config: ModelConfig, device: torch.device, attn_backend: type[AttentionBackend]) -> nn.Module:
    """Instantiate the architecture named in config.json on ``device`` in ``model_config.dtype``,
    its attention layers on ``attn_backend``, and load the checkpoint into it; or, with
    ``load_format`` "ipc_cache" (or "auto" and a matching store), map the model that
    ``pagedllm preload`` holds (``pagedllm.preload.ipc_cache``).

    Raises:
        ValueError: unsupported architecture or quantization method, a config.json key the
            model code would ignore (``pagedllm.arch_config.check_hf_config``), missing files, unknown
            tensor names, shape mismatches, or parameters the checkpoint does not provide;
            ``batch_invariant`` with a quantized model; with "ipc_cache", no preloaded
            weights or weights that differ (naming the field).
    """
    if model_config.load_format in ("auto", "ipc_cache"):
        from pagedllm.preload.ipc_cache import load_preloaded

        preloaded = load_preloaded(model_config, model_config.load_format == "ipc_cache", pack_weight)
        if preloaded is not None:
            return preloaded.eval()
    model_cls = get_model_class(model_config.architecture)
    if model_config.convert_type == "classify" and not hasattr(model_cls, "pooler_head"):
        model_cls = as_seq_cls_model(model_cls)  # --convert classify: a decoder with a score head
    check_hf_config(model_config.hf_config)
    quant_config = get_quant_config(model_config)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device), set_attn_backend(attn_backend), rope_cache_scope():
            model = model_cls(model_config.hf_config, quant_config)
    finally:
        torch.set_default_dtype(old_dtype)
    if isinstance(quant_config, GGUFConfig):
        weights = iterate_gguf_weights(model_config.model_path, model_config.hf_config, quant_config.kernel_modules)
    else:
        weights = iterate_weights(model_config.model_path)
    tokens = getattr(model_config.hf_config, "classifier_from_token", None)
    if tokens is not None and hasattr(model, "classifier_token_ids"):  # a score head from LM-head rows
        model.classifier_token_ids = classifier_token_ids(
            get_tokenizer(model_config.tokenizer_path, model_config.trust_remote_code), tokens)
    loaded = model.load_weights(weights)
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"Checkpoint {model_config.model_path} lacks weights for: {sorted(missing)[:8]}")
    if model_config.batch_invariant:
        use_batch_invariant_methods(model)
    paths = process_weights_after_loading(model)
    logger.info(
        "Model dtype %s; linear layers: %s",
        str(model_config.dtype).removeprefix("torch."),
        ", ".join(f"{count} x {path}" for path, count in paths.items()),
    )
    return model.eval()
