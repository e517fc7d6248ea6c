"""``AsyncLLM``: the asyncio front end of the server (vLLM V1's ``AsyncLLM``).

::

    generate() --validate, tokenize (Processor)--> AsyncMPClient --ZeroMQ--> EngineCoreProc
        ^                                                                        |
        |  RequestOutputCollector (one per request)                              |
        +---- output handler task: OutputProcessor.process_outputs <-- EngineCoreOutputs
                                   (detokenize, stop strings, n > 1), stats, metrics

The EngineCore (scheduler + model) runs in its own process, so the event loop only
tokenizes, detokenizes and moves messages; it never waits on a model step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncGenerator, Callable, Iterable, Mapping, Optional, Union

from prometheus_client import CollectorRegistry

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.client_factory import make_client
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.exceptions import EngineDeadError, EngineSleepingError
from pagedllm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, RequestStatsTracker
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer
from pagedllm.tracing import make_request_tracer

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Serve requests concurrently from asyncio, with the EngineCore in the background.

    Args:
        config: the resolved engine configuration.
        multiprocess: run the EngineCore in its own process (forked or spawned:
            ``mp_context``; the default, as the server does). False runs the same loop in a thread of this process (tests,
            notebooks); the event loop then shares the GIL with the model.
        log_stats: compute request statistics, update ``metrics_registry`` and feed the
            periodic stats line (``do_log_stats``). With ``--otlp-traces-endpoint``
            (``config.observability_config``) request statistics are computed anyway: each
            finished request's span (``pagedllm.tracing``) carries them.
        log_requests: log each added / aborted request id at INFO level.
        served_model_name: the ``model_name`` label of the metrics (default: the model).
        engine_core: an async client (``AsyncMPClient``, or ``DPAsyncMPClient`` for
            ``data_parallel_size`` > 1) already started (``wait_for_ready=False``) from
            the same settings; this instance owns it from now on. None starts one here.
            The constructor loads the tokenizer while the engine loads the model, and
            returns once the engine is ready.
        wait_for_ready: False returns before the engine is ready (the server builds its
            app meanwhile); call ``wait_for_ready()`` before the first request.

    Raises (constructor):
        ValueError: bad settings, as the engine reports them (e.g. a KV-cache budget too
            small for one ``max_model_len`` sequence, an unsupported architecture), or a
            tokenizer that cannot be loaded.
        EngineStartupError: the engine process crashed while starting.

    The constructor blocks until the model is loaded (unless ``wait_for_ready`` is False:
    ``wait_for_ready()`` then does, and raises the errors above that the engine reports).
    Use one instance from one event
    loop at a time (a later ``asyncio.run`` may reuse it once the previous loop ended).

    Attributes:
        model_config, processor, tokenizer (see ``get_tokenizer``).
        metrics_registry: this instance's ``prometheus_client.CollectorRegistry``
            (metrics in ``pagedllm.metrics.prometheus``); render it with
            ``prometheus_client.generate_latest(llm.metrics_registry)``.
    """

    def __init__(
        self,
        config: EngineConfig,
        multiprocess: bool = True,
        log_stats: bool = True,
        log_requests: bool = False,
        served_model_name: Optional[str] = None,
        engine_core: Optional[EngineCoreClient] = None,
        wait_for_ready: bool = True,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.log_stats = log_stats
        self.log_requests = log_requests
        self.served_model_name = served_model_name or config.model_config.model
        if engine_core is None:
            engine_core = _make_async_client(config, multiprocess)
        self.engine_core = engine_core
        try:
            self.tokenizer = get_tokenizer(config.model_config.tokenizer_path, config.model_config.trust_remote_code)
            self.processor = Processor(config.model_config, self.tokenizer, config.lora_config,
                                       config.structured_outputs_config, config.scheduler_config.policy,
                                       config.scheduler_config.max_num_batched_tokens)
        except BaseException:
            self.engine_core.shutdown(timeout_s=0)
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics_registry = CollectorRegistry()
        num_engines = config.parallel_config.data_parallel_size
        #: The Prometheus metrics, registered by ``wait_for_ready`` (they include the KV-cache size).
        self.stat_logger: Optional[PrometheusStatLogger] = None
        #: One stats line per engine (prefixed "Engine 001: " with data-parallel replicas, as vLLM).
        self.logging_stat_loggers = [
            LoggingStatLogger(engine_index=index if num_engines > 1 else None) for index in range(num_engines)
        ]
        self.stats_tracker = RequestStatsTracker()
        self.tracer = make_request_tracer(config.observability_config, self.served_model_name)
        self._tracks_requests = log_stats or self.tracer is not None
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._output_handler: Optional[asyncio.Task] = None
        self._handler_loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead_error: Optional[EngineDeadError] = None
        self._shut_down = False
        self._sleeping = False  # from the start of sleep() until everything is woken up
        if wait_for_ready:
            self.wait_for_ready()

    def wait_for_ready(self) -> None:
        """Block until the engine is ready (at once after the first time), then register the
        Prometheus metrics (``stat_logger``: they report the engine's KV-cache blocks).

        Raises:
            ValueError: bad settings, as the engine reports them (the engine is shut down).
            EngineStartupError: the engine process crashed while starting (likewise).
        """
        if self.stat_logger is not None:
            return
        try:
            self.engine_core.wait_for_ready(self.config)
        except BaseException:
            self.engine_core.shutdown(timeout_s=0)
            raise
        self.stat_logger = PrometheusStatLogger(
            self.metrics_registry, self.served_model_name, self.config,
            engine_indexes=range(self.config.parallel_config.data_parallel_size),
            num_gpu_blocks=self.engine_core.num_gpu_blocks,
        )

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        multiprocess: bool = True,
        *,
        log_stats: bool = True,
        log_requests: bool = False,
        served_model_name: Optional[str] = None,
        engine_core: Optional[EngineCoreClient] = None,
    ) -> "AsyncLLM":
        """Check the arguments, start the engine and return once it is ready.

        ``engine_core``: see the class docstring; without it the configuration is resolved
        first and the engine process started from it (a forked one inherits torch,
        transformers and the configuration instead of importing and resolving them again),
        which loads the model while this process loads the tokenizer.

        Raises:
            ValueError: bad arguments or settings (see the class docstring).
            OSError: a model directory without a readable config.json.
            EngineStartupError: the engine process crashed while starting.
        """
        try:
            config = engine_args.create_engine_config()
        except BaseException:
            if engine_core is not None:
                engine_core.shutdown(timeout_s=0)
            raise
        return cls(
            config,
            multiprocess,
            log_stats=log_stats,
            log_requests=log_requests,
            served_model_name=served_model_name,
            engine_core=engine_core,
        )

    # -- state ---------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the engine died or failed (it is never restarted)."""
        return self._dead_error is not None or self.engine_core.is_dead

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        """The error requests get once the engine is dead; None while it lives."""
        return self._dead_error or self.engine_core.dead_error

    @property
    def is_running(self) -> bool:
        """True while requests can be served (not errored, not shut down)."""
        return not self._shut_down and not self.errored

    @property
    def engine_pid(self) -> Optional[int]:
        """The engine process's pid (None when the engine runs in a thread; with data-parallel
        replicas, the first one's: see ``engine_core.engine_pids``)."""
        pids = self.engine_core.engine_pids
        return pids[0] if pids else None

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` if the engine is dead (or was shut down)."""
        self._check_alive()

    def _check_alive(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error.fresh()

    def get_tokenizer(self):
        """The HF tokenizer the front end uses (chat templates, tokenize / detokenize)."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """Engine requests (each of ``n`` completions counts one) not finished yet."""
        return self.output_processor.get_num_unfinished_requests()

    # -- requests --------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: Union[PromptType, EngineCoreRequest],
        sampling_params: Optional[SamplingParams] = None,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        prompt_text: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        trace_headers: Optional[Mapping[str, str]] = None,
        priority: int = 0,
    ) -> RequestOutputCollector:
        """Validate, tokenize and send a request; returns the collector its outputs go to.

        ``prompt`` may be an ``EngineCoreRequest`` already built by ``self.processor.process``
        (the OpenAI server does so to report errors before anything starts): it is sent
        as is, with its own id and params (``sampling_params``, ``cache_salt``,
        ``arrival_time``, ``lora_request`` and ``priority`` are then ignored), and ``prompt_text`` is its
        prompt's text. ``lora_request``: the LoRA adapter to run with (None: the base model).
        ``trace_headers``: the caller's W3C trace context (``pagedllm.tracing.TRACE_HEADERS``),
        the parent of the request's span when tracing is on.
        ``priority``: see ``Processor.process``.

        ``n > 1`` fans out into ``n`` engine requests ``f"{i}_{request_id}"`` joined
        into one output stream (``parallel_sampling.fan_out``).

        Raises:
            ValueError: bad prompt or parameters, a request id already in use, or an
                ``EngineCoreRequest`` whose id is not ``request_id`` (nothing is queued then).
            EngineDeadError: the engine is dead.
            EngineSleepingError: the engine is asleep, or going to sleep (``sleep``).
        """
        self._check_alive()
        if self._sleeping:
            raise EngineSleepingError("The model is sleeping; POST /wake_up (wake_up()) before sending requests.")
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already running.")
        if isinstance(prompt, EngineCoreRequest):
            if prompt.request_id != request_id:
                raise ValueError(f"The request's id {prompt.request_id!r} is not {request_id!r}.")
            request = prompt
        else:
            params = sampling_params if sampling_params is not None else SamplingParams()
            arrival_time = arrival_time if arrival_time is not None else time.time()
            request, prompt_text = self.processor.process(
                request_id, prompt, params, arrival_time, cache_salt, lora_request, priority
            )
        params = request.sampling_params
        self._ensure_output_handler()
        collector = RequestOutputCollector(params.output_kind)
        added: list[str] = []
        try:
            for child, parent, index in fan_out(request):
                self.output_processor.add_request(child, prompt_text, parent, index, collector)
                added.append(child.request_id)
                self._track(child, request_id, params, trace_headers)
                await self.engine_core.add_request_async(child)
        except BaseException:
            self._abort_engine_requests(self.output_processor.abort_requests(added))
            raise
        self._collectors[request_id] = collector
        if self.log_requests:
            logger.info(
                "Added request %s (%d prompt tokens, n=%d).",
                request_id,
                len(request.prompt_token_ids),
                params.n,
            )
        return collector

    def _track(
        self, request: EngineCoreRequest, parent_id: str, params: SamplingParams,
        trace_headers: Optional[Mapping[str, str]] = None,
    ) -> None:  # fmt: skip
        if not self._tracks_requests:
            return
        num_prompt = len(request.prompt_token_ids)
        max_tokens = self.processor.max_tokens_limit(num_prompt, params.max_tokens)
        self.stats_tracker.add_request(
            request.request_id, request.arrival_time, num_prompt, parent_id, params.n, max_tokens
        )
        if self.tracer is not None:
            self.tracer.add_request(request.request_id, parent_id, params, max_tokens, trace_headers)

    def _finish_request(self, request_id: str, reason: str, now: float, stats: IterationStats) -> None:
        """Account a finished (or aborted) engine request in ``stats``, and send its span."""
        state = self.stats_tracker.requests.get(request_id)
        self.stats_tracker.finish_request(request_id, reason, now, stats)
        if self.tracer is not None and state is not None:
            try:
                self.tracer.end_request(request_id, state, stats.finished_requests[-1], now)
            except Exception:  # a span must never fail a request
                logger.exception("Could not send the span of request %s", request_id)

    async def generate(
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
        """Generate for one prompt; yields ``RequestOutput``s as the engine produces them.

        What each output carries follows ``sampling_params.output_kind``: DELTA (only the
        new text / tokens; use for streaming), CUMULATIVE (everything so far) or
        FINAL_ONLY (one output at the end). Outputs that pile up while the consumer is
        busy are merged, so a slow consumer sees fewer, larger outputs, never stale ones.
        The last output has ``finished == True``.

        ``prompt``: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``,
        or an ``EngineCoreRequest`` from ``self.processor.process`` (with ``prompt_text``;
        see ``add_request``).
        ``cache_salt``: isolates this request's prefix-cache entries.
        ``lora_request``: the LoRA adapter to run with (None: the base model).
        ``trace_headers``: see ``add_request``.
        ``priority``: with ``--scheduling-policy priority``, lower runs first.

        If the consumer stops early (``aclose()``, ``break``, or the task is cancelled,
        e.g. a client disconnect), the request and all of its ``n`` completions are
        aborted in the engine; their blocks are free after the engine's current step.

        Raises:
            ValueError: bad prompt or parameters (before anything is queued).
            EngineDeadError: the engine is or becomes dead.
        """
        collector = await self.add_request(
            request_id, prompt, sampling_params, cache_salt, prompt_text=prompt_text, lora_request=lora_request,
            trace_headers=trace_headers, priority=priority,
        )  # fmt: skip
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except EngineDeadError:
            raise
        except BaseException:  # GeneratorExit, CancelledError, or an error while consuming
            if not finished:
                self._abort([request_id])
            raise
        finally:
            self._collectors.pop(request_id, None)

    async def encode(
        self, prompt: Union[PromptType, EngineCoreRequest], pooling_params: Optional[PoolingParams], request_id: str,
        prompt_text: Optional[str] = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt on a pooling model (vLLM's ``AsyncLLM.encode``); yields its one
        ``PoolingRequestOutput``. ``prompt`` as ``generate``'s, or an ``EngineCoreRequest`` from
        ``self.processor.process_pooling`` (then ``pooling_params`` is ignored).

        Raises:
            ValueError: a generative model, or bad prompt or parameters (before anything is queued).
            EngineDeadError: the engine is or becomes dead.
        """
        if not isinstance(prompt, EngineCoreRequest):
            prompt, prompt_text = self.processor.process_pooling(request_id, prompt, pooling_params or PoolingParams())
        async for output in self.generate(prompt, None, request_id, prompt_text=prompt_text):
            yield output  # type: ignore[misc]

    async def abort(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort requests (by the ids given to ``generate``; all ``n`` completions) and
        free their blocks in the engine. Unknown or finished ids are ignored. A consumer
        still iterating gets a last output with ``finish_reason == "abort"``."""
        self._abort([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort(self, request_ids: list[str]) -> None:
        child_ids = self.output_processor.abort_requests(request_ids)
        self._abort_engine_requests(child_ids)
        for request_id in request_ids:
            self._collectors.pop(request_id, None)
        if self.log_requests and child_ids:
            logger.info("Aborted request(s) %s.", ", ".join(request_ids))

    def _abort_engine_requests(self, child_ids: list[str]) -> None:
        if not child_ids:
            return
        engines = [self.engine_core.engine_index_of(child_id) for child_id in child_ids]
        self.engine_core.abort_requests(child_ids)
        if self._tracks_requests:
            now, stats = time.time(), {engine: IterationStats() for engine in engines}
            for child_id, engine in zip(child_ids, engines):
                self._finish_request(child_id, "abort", now, stats[engine])
            for engine, engine_stats in stats.items():
                if self.log_stats:
                    self._record_stats(None, engine_stats, engine)

    def abort_all(self, error: Exception) -> list[str]:
        """End every running request: abort it in the engine and raise ``error`` in its
        consumer (``generate``), instead of a last output. Returns the request ids ended.

        The server uses it at shutdown, after the grace period (``--shutdown-timeout``).
        """
        request_ids = list(self._collectors)
        self._end_all(request_ids, lambda: error)
        return request_ids

    def _end_all(self, request_ids: list[str], make_error: Callable[[], Exception]) -> None:
        collectors = [self._collectors[request_id] for request_id in request_ids]
        self._abort(request_ids)  # a dead engine is not sent the abort
        for collector in collectors:
            collector.put(make_error())

    async def reset_prefix_cache(self) -> None:
        """Forget every cached block.

        Raises:
            RuntimeError: while requests hold blocks.
            EngineDeadError: the engine is dead.
        """
        self._check_alive()
        self._ensure_output_handler()
        if not await self.engine_core.reset_prefix_cache_async():
            raise RuntimeError(
                "Cannot reset the prefix cache while requests are running; wait for them to finish."
            )

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``EngineCore.sleep``): from now on new requests are refused
        (``EngineSleepingError``); the unfinished ones finish first, then the engine frees
        its KV cache and takes the weights out of memory (level 1: into a file; level 2:
        dropped).

        Raises:
            ValueError: sleep mode off, or a bad level (the engine keeps serving).
            EngineDeadError: the engine is dead.
        """
        self._check_alive()
        self._sleeping = True
        try:
            while self.output_processor.has_unfinished_requests():
                await asyncio.sleep(0.01)
            await self._call_engines("sleep", level)
        except BaseException:
            self._sleeping = await self._engine_sleeping()
            raise

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Put back ``tags`` (``"weights"``, ``"kv_cache"``; None: both); requests are taken
        again once nothing is left asleep.

        Raises:
            ValueError: an unknown tag.
            EngineDeadError: the engine is dead.
        """
        self._check_alive()
        await self._call_engines("wake_up", tags)
        self._sleeping = await self._engine_sleeping()

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep or going to sleep (requests are refused)."""
        return self._sleeping

    async def _engine_sleeping(self) -> bool:
        return any(await self._call_engines("is_sleeping"))

    async def _call_engines(self, method: str, *args: object) -> list:
        """``EngineCore.<method>(*args)`` in every engine (each data-parallel replica); their results."""
        self._ensure_output_handler()
        result = await self.engine_core.call_utility_async(method, *args)  # type: ignore[attr-defined]
        return result if isinstance(result, list) else [result]

    # -- output handling --------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        handler = self._output_handler
        if handler is None or handler.done() or self._handler_loop is not loop:
            self._handler_loop = loop
            self._output_handler = loop.create_task(self._run_output_handler(), name="AsyncLLMOutputHandler")

    async def _run_output_handler(self) -> None:
        """Pull engine outputs forever: route them to collectors, abort stop-string
        finishes in the engine, record statistics. On engine death, fail every request."""
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                self._process_engine_outputs(outputs)
                # NOTE: get() of a non-empty queue does not yield; let other tasks
                # (e.g. health checks, new requests) run between engine steps.
                await asyncio.sleep(0)
        except EngineDeadError as error:
            self._fail_all(error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("AsyncLLM output handler failed")
            error = EngineDeadError(f"The output handler failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._dead_error = error
            self._fail_all(error)

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.time()
        stats = self.stats_tracker.update_from_outputs(outputs, now) if self._tracks_requests else None
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if stats is None:
            return
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._finish_request(output.request_id, str(output.finish_reason), now, stats)
        for request_id in processed.reqs_to_abort:  # finished by a stop string
            self._finish_request(request_id, "stop", now, stats)
        if self.log_stats:
            self._record_stats(outputs.scheduler_stats, stats, outputs.engine_index)

    def _record_stats(
        self, scheduler_stats: Optional[SchedulerStats], stats: IterationStats, engine_index: int = 0
    ) -> None:
        self.stat_logger.record(scheduler_stats, stats, engine_index)
        self.logging_stat_loggers[engine_index].record(scheduler_stats, stats)

    async def do_log_stats(self) -> None:
        """Log the stats line for the time since the previous call (vLLM's
        ``do_log_stats``; see ``pagedllm.metrics.loggers``). Nothing to log without
        ``log_stats``."""
        if self.log_stats:
            for stat_logger in self.logging_stat_loggers:
                stat_logger.log()

    def _fail_all(self, error: EngineDeadError) -> None:
        self._end_all(list(self._collectors), error.fresh)

    # -- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine (waits up to 5 s, then terminates it); idempotent. Requests
        still running get ``EngineDeadError``."""
        if self._shut_down:
            return
        self._shut_down = True
        handler = self._output_handler
        if handler is not None and not handler.done():
            try:
                same_loop = asyncio.get_running_loop() is self._handler_loop
            except RuntimeError:
                same_loop = False
            if same_loop:
                handler.cancel()
        if self.stat_logger is None:  # a start abandoned before the engine was ready: stopped at once
            self.engine_core.shutdown(timeout_s=0)
        else:
            self.engine_core.shutdown()
        self._fail_all(self.engine_core.dead_error or EngineDeadError("The engine was shut down."))
        if self.tracer is not None:
            self.tracer.shutdown()


def _make_async_client(config: EngineConfig | EngineArgs, multiprocess: bool) -> EngineCoreClient:
    """An async engine-core client (``make_client``), started but not waited for."""
    return make_client(config, multiprocess, asyncio_mode=True, wait_for_ready=False)
