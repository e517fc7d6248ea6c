"""``SchedulerConfig``: the batching limits of one engine step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: requests per step, tokens per step, context length (tokens)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


#: Default ``max_num_batched_tokens`` by (device type, usage context): vLLM's defaults
#: (``EngineArgs._set_default_args`` in vLLM 0.32).
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {
    ("cpu", "llm"): 4096,
    ("cpu", "api_server"): 2048,
    ("cuda", "llm"): 16384,
    ("cuda", "api_server"): 8192,
}


def default_max_num_batched_tokens(usage_context: str) -> int:
    """The step token budget used when none is given (see ``EngineArgs``).

    Raises:
        ValueError: for a usage context other than "llm" or "api_server".
    """
    from pagedllm.platforms import current_platform

    try:
        return _DEFAULT_MAX_NUM_BATCHED_TOKENS[(current_platform.device_type, usage_context)]
    except KeyError:
        raise ValueError(f"usage_context must be 'llm' or 'api_server', got {usage_context!r}.") from None
