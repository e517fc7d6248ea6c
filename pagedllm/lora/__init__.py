"""Multi-LoRA serving (vLLM's ``--enable-lora``; Punica / S-LoRA's batching of many adapters
over one base model).

- ``request.py``: ``LoRARequest`` (plain data; the contracts floor, no torch).
- ``peft_config.py``: reads and checks a PEFT adapter folder without loading its tensors.
- ``adapter.py``: loads an adapter's A/B matrices onto the model's fused layers.
- ``layers.py``: ``LoRALinearMethod``, wrapping a linear layer's ``quant_method``.
- ``model_manager.py``: the ``max_loras`` device slots, the LRU of loaded adapters and the
  per-step token -> slot mapping.

This ``__init__`` imports nothing, so the contracts can import ``pagedllm.lora.request``
without torch.
"""
