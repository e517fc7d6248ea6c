"""vLLM engine arguments accepted with only some of vLLM's values."""

from __future__ import annotations

from pagedllm.config.cache import KV_CACHE_DTYPES
from pagedllm.config.pooler import TASKS

#: vLLM engine arguments accepted with only some of vLLM's values: argument -> (the values
#: built here, why). ``EngineArgs`` refuses any other value at once: "... is not supported yet".
PARTLY_BUILT_ARGS: dict[str, tuple[tuple, str]] = {
    "distributed_executor_backend": ((None, "uni", "mp", "ray"), "pagedllm starts its own workers"),
    "load_format": (("auto", "safetensors", "gguf", "ipc_cache"),
                    "pagedllm loads *.safetensors checkpoints, .gguf files and preloaded weights"),
    "kv_cache_dtype": (("auto", *KV_CACHE_DTYPES), "the KV cache has the model's dtype or an FP8 type"),
    "tokenizer_mode": (("auto", "hf"), "pagedllm loads Hugging Face fast tokenizers"),
    "enable_chunked_prefill": ((None, True), "pagedllm always cuts long prompts into chunks"),
    "cpu_offload_gb": ((0,), "weights stay on the device"),
    "task": ((None, *TASKS), "pagedllm generates, embeds and classifies"),
}
