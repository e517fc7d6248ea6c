"""``LLMEngine``: the synchronous front end (as in vLLM): add requests, ``step()``, get
``RequestOutput``s. Tokenization and detokenization happen here; the ``EngineCore``
(scheduler + model runner) only sees token ids, through the same client layer as
``AsyncLLM`` (``EngineCoreClient.make_client``: here an ``InprocClient``, which calls the
in-process EngineCore directly, with no copy or serialisation).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Union

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_client import EngineCoreClient, InprocClient
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer


class LLMEngine:
    """Front end + in-process EngineCore.

    Args:
        config: resolved engine configuration (see ``EngineArgs.create_engine_config``).

    Attributes:
        engine_core_client: the ``EngineCoreClient`` every engine call goes through.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer_path)
        self.processor = Processor(config.model_config, self.tokenizer)
        self.engine_core_client = EngineCoreClient.make_client(config, multiprocess=False, asyncio_mode=False)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def engine_core(self) -> EngineCore:
        """The in-process ``EngineCore`` behind the client (scheduler, KV cache), to inspect."""
        client = self.engine_core_client
        assert isinstance(client, InprocClient)
        return client.engine_core

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Validate, tokenize and queue a request; ``n > 1`` fans out into ``n`` child requests.

        Raises:
            ValueError: for a bad prompt or parameters (nothing is queued then).
        """
        params = params or SamplingParams()
        request, prompt_text = self.processor.process(
            request_id, prompt, params, arrival_time or time.time(), cache_salt
        )
        for child, parent, index in fan_out(request):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core_client.add_request(child)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that progressed."""
        outputs = self.engine_core_client.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core_client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (by the ids given to ``add_request``) and free their blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core_client.abort_requests(self.output_processor.abort_requests(ids))

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

    def get_tokenizer(self):
        return self.tokenizer
