"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine."""

from pagedllm.logger import configure_logging

configure_logging()

from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.entrypoints.llm import LLM  # noqa: E402
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from pagedllm.version import __version__  # noqa: E402

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]
