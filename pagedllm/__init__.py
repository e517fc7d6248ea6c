"""pagedllm: a high-throughput, memory-efficient LLM inference and serving engine."""

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.version import __version__

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
