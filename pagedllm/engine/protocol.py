"""``EngineClient``: what the OpenAI server asks of its engine (vLLM's ``EngineClient``).

The front end (``entrypoints/openai``: ``build_app``, the serving classes, ``serve_http``)
holds its engine through this protocol and calls nothing else on it. ``AsyncLLM`` implements
it structurally (``tests/engine/test_protocol.py`` checks every member and signature); a test
may hand the front end any object with the members it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncGenerator, Mapping, Optional, Protocol, Union

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pagedllm.config import ModelConfig
    from pagedllm.engine.exceptions import EngineDeadError
    from pagedllm.engine.processor import Processor, PromptType
    from pagedllm.lora.request import LoRARequest
    from pagedllm.messages.engine_core import EngineCoreRequest
    from pagedllm.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams

#: What sleep mode takes away and ``wake_up(tags)`` can put back (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")


class EngineClient(Protocol):
    """An engine serving requests from asyncio.

    Attributes:
        model_config: the served model's configuration (name, path, ``max_model_len``).
        processor: the one validation point: requests are checked and turned into
            ``EngineCoreRequest``s by it before ``generate`` (``check_lora`` checks adapters).
        metrics_registry: the Prometheus registry ``/metrics`` renders.
    """

    model_config: ModelConfig
    processor: Processor
    metrics_registry: CollectorRegistry

    @property
    def errored(self) -> bool:
        """True once the engine died or failed (it is never restarted)."""
        ...

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        """The error requests get once the engine is dead; None while it lives."""
        ...

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` if the engine is dead (or was shut down)."""
        ...

    def get_tokenizer(self) -> Any:
        """The HF tokenizer the front end uses (chat templates, tokenize / detokenize)."""
        ...

    def get_num_unfinished_requests(self) -> int:
        """Engine requests (each of ``n`` completions counts one) not finished yet."""
        ...

    def generate(
        self,
        prompt: Union[PromptType, EngineCoreRequest],
        sampling_params: Optional[SamplingParams],
        request_id: str,
        cache_salt: Optional[str] = None,
        prompt_text: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        trace_headers: Optional[Mapping[str, str]] = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``RequestOutput``s of one request as the engine produces them, the last one
        ``finished``; closing the generator early aborts the request (all ``n`` completions).
        ``trace_headers``: the caller's W3C trace context, the parent of the request's span
        when tracing is on. ``priority``: its place under the priority scheduling policy
        (lower runs first).

        Raises:
            ValueError: bad prompt or parameters (before anything is queued).
            EngineDeadError: the engine is or becomes dead.
        """
        ...

    def abort_all(self, error: Exception) -> list[str]:
        """End every running request, raising ``error`` in its consumer; returns their ids."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Refuse new requests, let the unfinished ones finish, then free the KV cache and
        take the weights out of memory (level 1: kept in a file; level 2: dropped)."""
        ...

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Put back ``tags`` (``SLEEP_TAGS``; None: all); requests are taken once all are back."""
        ...

    async def is_sleeping(self) -> bool:
        """Whether requests are refused because the engine sleeps (or is going to)."""
        ...

    async def do_log_stats(self) -> None:
        """Log the stats line for the time since the previous call."""
        ...

    def shutdown(self) -> None:
        """Stop the engine; idempotent. Requests still running get ``EngineDeadError``."""
        ...
