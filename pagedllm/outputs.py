"""What users get back: ``RequestOutput`` and ``CompletionOutput``, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union


@dataclass
class Logprob:
    """Log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the model's raw output distribution
            (before temperature and penalties, as vLLM V1 returns by default).
        rank: 1-based rank of the token among all vocabulary entries (1 = most likely).
        decoded_token: the token's text, or None when detokenization is off.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: Per position: token id -> Logprob (the top-k tokens plus the sampled/actual one).
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
#: The first prompt position has no logprob (nothing precedes it), hence None.
PromptLogprobs = list[Optional[PositionLogprobs]]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    Attributes:
        index: position among the request's ``n`` completions.
        text: generated text (cumulative or delta, by ``SamplingParams.output_kind``).
        token_ids: generated token ids (cumulative or delta likewise).
        cumulative_logprob: sum of the sampled tokens' logprobs, when logprobs are on.
        logprobs: per generated token, when ``SamplingParams.logprobs`` is set.
        finish_reason: None while running, then "stop" (EOS, stop string or stop token)
            or "length" (max_tokens or max_model_len), or "abort".
        stop_reason: the stop string or stop token id that ended it; None for EOS or
            length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request (all of its completions).

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when the request was given as text.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token, when ``SamplingParams.prompt_logprobs`` is set.
        outputs: the completions, ordered by index.
        finished: True once every completion has finished.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
        kv_transfer_params: a prefill / decode split (vLLM's): on a producer's final output,
            what a consumer's request needs to load the prompt's KV; on a consumer's output
            whose load failed (finish reason "abort"), ``{"error": reason}``; else None.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[dict] = field(default=None, repr=False)
    kv_transfer_params: Optional[dict] = None


@dataclass
class PoolingOutput:
    """A pooling request's result. ``data``: the pooled vector (float values; vLLM holds a
    tensor), after the request's ``PoolingParams`` (``dimensions``, ``normalize``)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request, as vLLM's: it has one, final, output.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt's token ids (after truncation): its length is the
            request's ``usage.prompt_tokens``.
        outputs: the pooled vector.
        finished: always True.
        prompt: the prompt text, when given as text.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
    """

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """An embedding: ``embedding`` float values (vLLM's ``EmbeddingOutput``); ``hidden_size`` its length."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class _TaskRequestOutput:
    """A pooling request's output seen as one task's (``output_cls`` built from its values)."""

    output_cls: ClassVar[type]

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, request_output: PoolingRequestOutput) -> Any:
        """This task's view of a pooling request's output."""
        return cls(request_output.request_id, cls.output_cls(request_output.outputs.data),
                   request_output.prompt_token_ids, request_output.finished, request_output.num_cached_tokens)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    """``LLM.embed``'s result per prompt: ``outputs.embedding`` (vLLM's ``EmbeddingRequestOutput``)."""

    output_cls = EmbeddingOutput
    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities (vLLM's ``ClassificationOutput``): ``probs`` one value
    per label (config.json's ``id2label`` order), after the model's activation."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    """``LLM.classify``'s result per prompt: ``outputs.probs`` (vLLM's ``ClassificationRequestOutput``)."""

    output_cls = ClassificationOutput
    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    """The score of one text pair (vLLM's ``ScoringOutput``): a cross-encoder's activated
    logit, or the cosine similarity of an embedding model's two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result per pair: ``outputs.score`` (vLLM's ``ScoringRequestOutput``).
    ``prompt_token_ids``: the pair's tokens (a cross-encoder's pair input; an embedding
    model's two prompts one after the other)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
