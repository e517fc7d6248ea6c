"""Images into the engine (vLLM's ``vllm.multimodal``): a prompt's ``multi_modal_data``
goes through the model's own transformers processor (``processing``), each item is keyed
by the hash of its content (``hasher``) and travels as a ``MultiModalFeatureSpec``
(``inputs``) beside the prompt's token ids, which hold its placeholder tokens; ``media``
loads images from ``data:`` / ``file://`` / ``http(s)://`` URLs for the chat APIs."""
