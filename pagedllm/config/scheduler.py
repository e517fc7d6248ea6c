"""``SchedulerConfig``: the batching limits of one engine step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pagedllm.config.engine_args import EngineArgs

#: ``--scheduling-policy`` values (vLLM's ``SchedulerPolicy``; ``pagedllm.core.request_queue``).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits: requests per step, tokens per step, context length (tokens).

    ``chunked_prefill_enabled`` False (an encoder, which needs its whole prompt in one
    pass): a prompt that does not fit the step's remaining budget waits for a later step.
    ``policy`` (vLLM's ``--scheduling-policy``): "fcfs" or "priority" (``pagedllm.core.request_queue``).
    ``max_num_active_seqs``: the most requests admitted to RUNNING at once (None:
    ``max_num_seqs``); ``max_num_seqs`` still sizes the runner's batch.
    ``disable_chunked_mm_input`` (vLLM's): a step never ends inside an image's placeholder
    tokens; it stops before the image instead (set for the models whose image tokens attend
    both ways, ``pagedllm.arch_config.BIDIRECTIONAL_IMAGE_ARCHITECTURES``, whose attention
    across such a cut has no representation, as vLLM does).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill_enabled: bool = True
    policy: str = "fcfs"
    max_num_active_seqs: Optional[int] = None
    disable_chunked_mm_input: bool = False

    @property
    def max_running_reqs(self) -> int:
        """The admission cap: ``max_num_active_seqs``, else ``max_num_seqs``."""
        return self.max_num_active_seqs or self.max_num_seqs

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        """The limits of ``args``; ``max_num_batched_tokens`` defaults by device and use
        (``default_max_num_batched_tokens``), and never below ``max_num_seqs``.

        Raises:
            ValueError: a token budget below 1; ``max_num_active_seqs`` above ``max_num_seqs``.
        """
        max_num_batched_tokens = args.max_num_batched_tokens or max(
            default_max_num_batched_tokens(args.usage_context), args.max_num_seqs
        )
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}.")
        active = args.max_num_active_seqs
        if active is not None and not 1 <= active <= args.max_num_seqs:
            raise ValueError(f"max_num_active_seqs must be between 1 and max_num_seqs ({args.max_num_seqs}), got {active}.")
        return cls(args.max_num_seqs, max_num_batched_tokens, max_model_len,
                   policy=args.scheduling_policy, max_num_active_seqs=active)


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
