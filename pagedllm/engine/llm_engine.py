"""``LLMEngine``: the synchronous front end (as in vLLM): add requests, ``step()``, get
``RequestOutput``s. Tokenization and detokenization happen here; the ``EngineCore``
(scheduler + model runner) only sees token ids, through the same client layer as
``AsyncLLM`` (``client_factory.make_client``: here an ``InprocClient``, which calls the
in-process EngineCore directly, with no copy or serialisation).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Union

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.client_factory import make_client
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.exceptions import EngineSleepingError
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.messages.engine_core import EngineCoreOutputs
from pagedllm.metrics.loggers import LoggingStatLogger, log_stats_interval
from pagedllm.metrics.stats import IterationStats, RequestStatsTracker
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer


class LLMEngine:
    """Front end + in-process EngineCore.

    Args:
        config: resolved engine configuration (see ``EngineArgs.create_engine_config``).
        log_stats: log vLLM's stats line (``pagedllm.metrics.loggers``) every
            ``log_stats_interval()`` seconds from ``step()``.

    Attributes:
        engine_core_client: the ``EngineCoreClient`` every engine call goes through.
    """

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer_path, config.model_config.trust_remote_code)
        self.processor = Processor(config.model_config, self.tokenizer, config.lora_config, config.structured_outputs_config,
                                   config.scheduler_config.policy, config.scheduler_config.max_num_batched_tokens)
        self.engine_core_client = make_client(config, multiprocess=False, asyncio_mode=False)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._sleeping = False
        self.stat_logger: Optional[LoggingStatLogger] = None
        if log_stats:
            self.stat_logger = LoggingStatLogger()
            self.stats_tracker = RequestStatsTracker()
            self._log_interval_s = log_stats_interval()

    @property
    def engine_core(self) -> EngineCore:
        """The in-process ``EngineCore`` behind the client (scheduler, KV cache), to inspect."""
        client = self.engine_core_client
        assert isinstance(client, InprocClient)
        return client.engine_core

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config(), log_stats=not engine_args.disable_log_stats)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Union[SamplingParams, PoolingParams, None] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> None:
        """Validate, tokenize and queue a request; ``n > 1`` fans out into ``n`` child requests.
        ``lora_request``: the LoRA adapter to run it with (None: the base model). ``priority``:
        see ``Processor.process``. With
        ``PoolingParams`` (a pooling model; ``Processor.process_pooling``) its one output is a
        ``PoolingRequestOutput``.

        Raises:
            ValueError: for a bad prompt, parameters or adapter (nothing is queued then).
            FileNotFoundError: no adapter at ``lora_request.lora_path``.
            EngineSleepingError: the engine is asleep (``sleep``).
        """
        if self._sleeping:
            raise EngineSleepingError("The engine is sleeping; call wake_up() before adding requests.")
        if isinstance(params, PoolingParams):
            request, prompt_text = self.processor.process_pooling(request_id, prompt, params, arrival_time)
        else:
            request, prompt_text = self.processor.process(
                request_id, prompt, params or SamplingParams(), arrival_time or time.time(), cache_salt, lora_request,
                priority,
            )
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core_client.add_request(child)
            if self.stat_logger is not None:
                self.stats_tracker.add_request(child.request_id, request.arrival_time, len(child.prompt_token_ids))

    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """Run one engine step; returns the outputs of requests that progressed."""
        outputs = self.engine_core_client.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core_client.abort_requests(processed.reqs_to_abort)
        if self.stat_logger is not None:
            self._log_stats(outputs, processed.reqs_to_abort)
        return processed.request_outputs

    def _log_stats(self, outputs: EngineCoreOutputs, stopped_ids: list[str]) -> None:
        now = time.time()
        stats = self.stats_tracker.update_from_outputs(outputs, now)
        finished = [(o.request_id, str(o.finish_reason)) for o in outputs.outputs if o.finish_reason is not None]
        for request_id, reason in finished + [(r, "stop") for r in stopped_ids]:
            self.stats_tracker.finish_request(request_id, reason, now, stats)
        assert self.stat_logger is not None
        self.stat_logger.record(outputs.scheduler_stats, stats)
        if time.monotonic() - self.stat_logger.last_log_time >= self._log_interval_s:
            self.stat_logger.log()

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (by the ids given to ``add_request``) and free their blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = self.output_processor.abort_requests(ids)
        self.engine_core_client.abort_requests(child_ids)
        if self.stat_logger is not None:
            now, stats = time.time(), IterationStats()
            for child_id in child_ids:
                self.stats_tracker.finish_request(child_id, "abort", now, stats)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block.

        Raises:
            RuntimeError: while requests hold blocks.
        """
        if not self.engine_core_client.reset_prefix_cache():
            raise RuntimeError("Cannot reset the prefix cache while requests are running; wait for them to finish.")

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and take the weights out of memory (``EngineCore.sleep``).

        Raises:
            ValueError: sleep mode off, or a bad level.
            RuntimeError: while requests are unfinished.
        """
        self.engine_core_client.call_utility("sleep", level)
        self._sleeping = True

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Put back ``tags`` (``"weights"``, ``"kv_cache"``; None: both) (``EngineCore.wake_up``)."""
        self.engine_core_client.call_utility("wake_up", tags)
        self._sleeping = bool(self.engine_core_client.call_utility("is_sleeping"))

    def is_sleeping(self) -> bool:
        """Whether anything ``sleep`` took is still away (no request is taken until then)."""
        return self._sleeping

    def get_tokenizer(self):
        return self.tokenizer
