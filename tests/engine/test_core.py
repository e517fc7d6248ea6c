"""EngineCore reaches the model only through its executor: a fake executor plugged in by
``distributed_executor_backend`` runs the whole schedule -> execute -> update loop with no
model, and sees the set-up calls, every step and the shutdown."""

from __future__ import annotations

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.processor import Processor
from pagedllm.executor.abstract import Executor
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.tokenizer import get_tokenizer

FAKE_NUM_BLOCKS = 200


class FakeWorker:
    """Counts tokens like a runner; a request that has computed all its known tokens
    samples ``100 + its number of tokens``."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}
        self.num_blocks = 0

    def determine_num_available_blocks(self) -> int:
        return FAKE_NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        for req_id, computed in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            self.num_computed[req_id] = computed
        order = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in order:
            self.num_computed[req_id] += so.num_scheduled_tokens[req_id]
            if self.num_computed[req_id] < self.num_tokens[req_id]:
                sampled.append([])
                continue
            sampled.append([100 + self.num_tokens[req_id]])
            self.num_tokens[req_id] += 1
        return ModelRunnerOutput(order, {r: i for i, r in enumerate(order)}, sampled)


class FakeExecutor(Executor):
    """One ``FakeWorker``; records every call by name."""

    def _init_executor(self) -> None:
        self.worker = FakeWorker()
        self.calls: list[str] = []
        self.num_shutdowns = 0

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None) -> list:
        self.calls.append(method)
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.num_shutdowns += 1


def make_config(path):
    return EngineArgs(model=str(path), distributed_executor_backend=FakeExecutor).create_engine_config()


def test_engine_core_runs_the_loop_through_its_executor(tiny_llama):
    config = make_config(tiny_llama)
    core = EngineCore(config)
    executor = core.model_executor
    assert isinstance(executor, FakeExecutor)
    assert executor.calls == ["determine_num_available_blocks", "initialize_kv_cache"]
    assert executor.worker.num_blocks == core.num_gpu_blocks == FAKE_NUM_BLOCKS
    assert core.kv_cache_manager.block_pool.num_blocks == FAKE_NUM_BLOCKS

    processor = Processor(config.model_config, get_tokenizer(config.model_config.tokenizer_path))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for req_id, prompt in [("a", [5, 6, 7]), ("b", list(range(40)))]:
        core.add_request(processor.process(req_id, {"prompt_token_ids": prompt}, params)[0])
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    num_steps = 0
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
        num_steps += 1
    assert tokens == {"a": [103, 104, 105], "b": [140, 141, 142]}
    assert executor.calls[2:] == ["execute_model"] * num_steps
    pool = core.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == FAKE_NUM_BLOCKS

    core.shutdown()
    assert executor.num_shutdowns == 1


def test_inproc_client_shutdown_stops_the_executor(tiny_llama):
    client = InprocClient(make_config(tiny_llama))
    client.shutdown()
    assert client.engine_core.model_executor.num_shutdowns == 1
