"""Images and videos into the engine (vLLM's ``vllm.multimodal``): a prompt's
``multi_modal_data`` goes through the model's own transformers processor (``processing``;
Qwen-VL videos through ``qwen_video``), each item is keyed by the hash of its content
(``hasher``) and travels as a ``MultiModalFeatureSpec`` (``inputs``) beside the prompt's token
ids, which hold its placeholder tokens; ``media`` loads images and videos from ``data:`` /
``file://`` / ``http(s)://`` URLs for the chat APIs, ``video`` decodes and samples videos."""
