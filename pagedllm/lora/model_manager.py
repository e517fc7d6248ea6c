"""``LoRAModelManager``: the model runner's side of multi-LoRA. It wraps the decoder's
linear layers in ``LoRALinearMethod``, keeps ``max_loras`` device slots (LRU) and an LRU of
``max_cpu_loras`` loaded adapters, and each step maps tokens to slots (vLLM's
``LoRAModelManager`` / ``LRUCacheWorkerLoRAManager`` roles, in one small class).

The scheduler never runs more than ``max_loras`` distinct adapters in one step, so the
adapters of a step always fit in the slots.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.layers import LoRALinearMethod, LoRAStepMapping
from pagedllm.lora.request import LoRARequest
from pagedllm.model_executor.layers.linear import LinearBase

logger = logging.getLogger(__name__)

AdapterKey = tuple[str, int, int]


def language_model(model: nn.Module) -> nn.Module:
    """The module whose ``model.layers.*`` an adapter adapts: an image-text model's
    ``language_model``, else ``model`` itself."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


class LoRAModelManager:
    """Multi-LoRA state of one model on one device.

    Args:
        model: a Llama-family model (``model.layers.<i>`` decoder layers, a
            ``stacked_params_mapping`` of fused q/k/v and gate/up), or an image-text model whose
            ``language_model`` is one (``language_model``: only its layers are adapted; the
            vision tower and projector never are), weights loaded.
        hf_config: its HF config (to check adapters).
        max_loras: device slots; max_lora_rank: the largest rank; max_cpu_loras: adapters
            kept loaded in CPU memory (at least ``max_loras``).
        device, dtype: the model's (the slots' A and B are stored in its dtype).
    """

    def __init__(
        self, model: nn.Module, hf_config: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.mapping = LoRAStepMapping()
        self.methods: dict[str, LoRALinearMethod] = {}
        model = language_model(model)
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and name.startswith("model.layers."):
                method = LoRALinearMethod(module.quant_method, module, max_loras, max_lora_rank, self.mapping, device,
                                          dtype)
                module.quant_method = method
                self.methods[name] = method
            if hasattr(module, "chunk_rows"):
                # NOTE: the step's token groups index all its tokens, so each layer must see
                # the whole batch: the MLP's row chunking (a CPU memory trick) is turned off.
                module.chunk_rows = False
        self.stacked_params_mapping = list(getattr(model, "stacked_params_mapping", []))
        self.shard_ids = {name: getattr(module, "shard_ids", [0]) for name, module in model.named_modules()
                          if name in self.methods}
        self.slots: list[Optional[AdapterKey]] = [None] * max_loras
        self.slot_lru: OrderedDict[AdapterKey, int] = OrderedDict()
        self.cpu_cache: OrderedDict[AdapterKey, LoRAAdapter] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot tensor."""
        return sum(m.nbytes for m in self.methods.values())

    def _target(self, module: str) -> tuple[str, int]:
        """Checkpoint module name -> (wrapped layer name, output slice index)."""
        dotted = module + "."
        for fused, ckpt, shard_id in self.stacked_params_mapping:
            if ckpt in dotted:
                layer = dotted.replace(ckpt, fused)[:-1]
                return layer, self.shard_ids[layer].index(shard_id)
        return module, 0

    def _loaded(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from the CPU cache, or loaded from disk (evicting the least recently used)."""
        key = request.adapter_key
        adapter = self.cpu_cache.get(key)
        if adapter is None:
            start = time.perf_counter()
            adapter = load_adapter(request, self.hf_config, self.max_lora_rank)
            logger.info("Loaded LoRA adapter %s (id %d, rank %d) from %s in %.3f s", request.lora_name,
                        request.lora_int_id, adapter.rank, request.lora_path, time.perf_counter() - start)
            while len(self.cpu_cache) >= self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
            self.cpu_cache[key] = adapter
        self.cpu_cache.move_to_end(key)
        return adapter

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        per_layer: dict[str, list[Optional[tuple[torch.Tensor, torch.Tensor]]]] = {
            name: [None] * len(method.output_sizes) for name, method in self.methods.items()
        }
        for module, (a, b) in adapter.modules.items():
            layer, index = self._target(module)
            if layer not in per_layer:
                raise ValueError(f"LoRA adapter {adapter.key[0]!r}: the model has no layer {module!r}.")
            per_layer[layer][index] = (a, b)
        for name, slices in per_layer.items():
            self.methods[name].set_slot(slot, slices)

    def activate(self, requests: Sequence[Optional[LoRARequest]]) -> tuple[np.ndarray, dict[AdapterKey, str]]:
        """Put the adapters of this step's requests in device slots (reusing a slot that
        holds one already; else the least recently used slot no request of this step needs).

        Returns:
            the slot of each request [len(requests)] int64 (-1: no adapter, or one that
            failed), and adapter key -> why it could not be loaded (its files are gone or
            changed since the front end checked them; logged), for the runner to fail those.

        Raises:
            RuntimeError: more distinct adapters than slots (the scheduler prevents it).
        """
        keys = {r.adapter_key: r for r in requests if r is not None}
        if len(keys) > len(self.slots):
            raise RuntimeError(f"{len(keys)} LoRA adapters in one step, but max_loras is {len(self.slots)}.")
        failed: dict[AdapterKey, str] = {}
        for key, request in keys.items():
            if key in self.slot_lru:
                self.slot_lru.move_to_end(key)
                continue
            try:
                adapter = self._loaded(request)
                slot = self._free_slot(keys)
                self.slots[slot] = None  # until written whole
                self._write_slot(slot, adapter)
            except (OSError, ValueError) as exc:
                failed[key] = f"LoRA adapter {request.lora_name!r} could not be loaded: {exc}"
                logger.error("%s", failed[key])
                continue
            self.slots[slot] = key
            self.slot_lru[key] = slot
        slots = np.fromiter((-1 if r is None or r.adapter_key in failed else self.slot_lru[r.adapter_key]
                             for r in requests), dtype=np.int64, count=len(requests))
        return slots, failed

    def _free_slot(self, needed: dict[AdapterKey, LoRARequest]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        victim = next(key for key in self.slot_lru if key not in needed)
        return self.slot_lru.pop(victim)

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """Tell every wrapped layer this step's slot of each token (``token_slots`` [T]
        int64, -1 = no adapter; best ordered by slot: see ``LoRAStepMapping``)."""
        self.mapping.set_token_slots(token_slots)
