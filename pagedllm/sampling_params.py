"""Per-request decoding settings, with vLLM's field names and defaults.

Source of the fields and their meaning: vLLM's ``SamplingParams`` and the OpenAI
completions API (``presence_penalty``, ``frequency_penalty``, ``logit_bias``).
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Mapping, Optional, Union

import msgspec

#: ``max_tokens`` when a request does not set it (vLLM's and OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16

#: Largest ``n``: each completion is its own engine request (a cap on one request's load).
MAX_N = 128

#: ``seed`` bounds: what msgpack (the engine-core transport) carries, int64 to uint64.
SEED_RANGE = (-(2**63), 2**64)

#: Below this temperature a request is treated as greedy (avoids dividing by ~0).
_GREEDY_TEMPERATURE = 1e-5


def check_max_tokens(max_tokens: Optional[int], field: str = "max_tokens") -> None:
    """The bound of ``max_tokens`` (None, or at least 1), for ``SamplingParams`` and for the
    request field ``field`` that sets it.

    Raises:
        ValueError: ``"{field} must be at least 1, got {max_tokens!r}."``.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"{field} must be at least 1, got {max_tokens!r}.")


def check_logprobs(logprobs: Optional[int], field: str = "logprobs") -> None:
    """The bound of ``logprobs`` / ``prompt_logprobs`` (None, or at least 0), for
    ``SamplingParams`` and for the request field ``field`` that sets it (chat's
    ``top_logprobs``). The upper bound is the engine's ``max_logprobs`` (``Processor``, as vLLM).

    Raises:
        ValueError: ``"{field} must be non-negative, got {logprobs!r}."``.
    """
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"{field} must be non-negative, got {logprobs!r}.")


def check_best_of(best_of: Optional[int], n: int) -> None:
    """``best_of`` must be unset or equal to ``n``: pagedllm, like vLLM V1, returns every
    completion it generates (no best-of-n selection by cumulative logprob).

    Raises:
        ValueError: ``"best_of is not supported ..."`` with both values.
    """
    if best_of is not None and best_of != n:
        raise ValueError(f"best_of is not supported (it must be unset or equal to n); got best_of={best_of}, n={n}.")


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request carries.

    CUMULATIVE: all text and tokens so far; DELTA: only what is new since the last
    output; FINAL_ONLY: one output, when the request finishes (the offline default).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


#: The constraint fields of ``StructuredOutputsParams``: a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    dict=True,  # type: ignore[call-arg]
):
    """A constraint on a request's output (constrained decoding), with vLLM's field names.

    Exactly one of the constraint fields (``STRUCTURED_OUTPUT_KINDS``) is set:
        json: a JSON schema (a dict, e.g. a Pydantic model's ``model_json_schema()``, or
            its JSON text); the output is a JSON value that validates against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a grammar in the backend's syntax (EBNF / GBNF; Lark for guidance).
        json_object: True: the output is any JSON object (OpenAI's ``json_object`` mode).
        structural_tag: a structural-tag specification (JSON text), as xgrammar defines it.
    Options:
        whitespace_pattern: a regex for the whitespace allowed between JSON tokens.
        disable_any_whitespace: JSON without any whitespace between tokens.
        disable_additional_properties: schemas without ``additionalProperties`` allow no
            extra keys (as if it were false).

    Source: vLLM's ``StructuredOutputsParams`` (``vllm/sampling_params.py``).

    Raises:
        ValueError: from ``__post_init__`` when no constraint or more than one is set (the
            message names the ones set), or ``choice`` is empty or not all strings.
    """

    json: Any = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    whitespace_pattern: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        chosen = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            found = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                "structured outputs take exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {found}."
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(option, str) for option in self.choice)
        ):
            raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set (one of ``STRUCTURED_OUTPUT_KINDS``)."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))


#: The keys a consumer's ``kv_transfer_params`` must carry, and their types.
_REMOTE_PREFILL_KEYS = {"remote_host": str, "remote_port": int, "remote_request_id": str}


def check_kv_transfer_params(params: Any, n: int = 1) -> None:
    """Check a request's ``kv_transfer_params`` (vLLM's): None, or a dict asking for
    ``do_remote_decode`` (a producer keeps the prompt's KV) or ``do_remote_prefill`` (a
    consumer loads it; then with ``remote_host``, ``remote_port`` and ``remote_request_id``,
    as the producer's output gives them), for one completion (``n`` 1).

    Raises:
        ValueError: "kv_transfer_params ..." naming what is wrong.
    """
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {params!r}.")
    if (params.get("do_remote_decode") or params.get("do_remote_prefill")) and n != 1:
        raise ValueError(f"kv_transfer_params asks for a prefill / decode split, which serves n=1 only, got n={n}.")
    if params.get("do_remote_prefill"):
        for key, kind in _REMOTE_PREFILL_KEYS.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params with do_remote_prefill needs {key} ({kind.__name__}, as the "
                                 f"prefill instance's response gives it), got {value!r}.")


#: The older name, used by vLLM's docs and many tutorials (``guided_decoding=``).
GuidedDecodingParams = StructuredOutputsParams


class SamplingParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    dict=True,  # type: ignore[call-arg]
):
    """Sampling settings of one request.

    Fields (defaults as in vLLM):
        n: number of completions returned for the prompt, 1 to ``MAX_N``.
        presence_penalty: subtracted once from the logit of every token already in
            the output (OpenAI definition), in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per occurrence in the
            output (OpenAI definition), in [-2, 2].
        repetition_penalty: logits of tokens in the prompt or output are divided by it
            when positive and multiplied by it when negative (CTRL paper,
            arXiv:1909.05858, as implemented by HF transformers); 1 disables.
        temperature: logits are divided by it; 0 means greedy.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p.
        top_k: keep the k most likely tokens; 0 or -1 disables (as vLLM; 0 is stored as -1).
        min_p: drop tokens whose probability is below min_p x the top probability.
        seed: per-request RNG seed; the output then does not depend on the batch
            (in ``SEED_RANGE``).
        stop: strings that end generation (matched on the detokenized text).
        stop_token_ids: token ids that end generation.
        ignore_eos: keep generating after the EOS token.
        max_tokens: maximum number of generated tokens; None means up to max_model_len.
        min_tokens: EOS, stop token ids and stop strings are ignored before this many
            tokens were generated.
        logprobs: number of top log-probabilities returned per generated token (the
            sampled token's is always added); at most the engine's ``max_logprobs``
            (checked by the engine's ``Processor``, as vLLM).
        prompt_logprobs: the same for each prompt token.
        detokenize: produce text (else only token ids).
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: put spaces around special tokens in the text.
        logit_bias: token id -> value added to its logit, in [-100, 100].
        include_stop_str_in_output: keep the matched stop string in the text.
        output_kind: see ``RequestOutputKind``.
        structured_outputs: a ``StructuredOutputsParams`` constraint on the output, or None.
        guided_decoding: the older name of ``structured_outputs`` (vLLM's docs and
            tutorials); given alone, it is moved to ``structured_outputs``.
        best_of: None or ``n`` (see ``check_best_of``).
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last
            ``max_model_len``); None keeps the whole prompt (vLLM's field; applied by the
            engine's ``Processor`` after tokenizing).
        allowed_token_ids: when set, only these token ids can be sampled (a non-empty list).
        bad_words: words that cannot be generated: the last token of a word is banned
            whenever the output ends with the word's other tokens. Each word is tokenized
            alone and after a space (``update_from_tokenizer``), as vLLM does.
        extra_args: vLLM's free-form dict; its ``"kv_transfer_params"`` (a prefill / decode
            split, ``check_kv_transfer_params``) is the one key read here.

    These are the only range rules of a request's sampling fields: the OpenAI server
    builds a ``SamplingParams`` and answers its ``ValueError`` with a 400, so offline and
    online accept the same values.

    Raises:
        ValueError: from ``__post_init__`` if any field is out of range; the message
            starts with the field's name and gives the value.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None
    best_of: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    extra_args: Optional[dict[str, Any]] = None
    #: ``bad_words`` as token-id sequences, set by ``update_from_tokenizer``.
    _bad_words_token_ids: Optional[list[list[int]]] = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("set structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._verify()
        if self.extra_args is not None:
            check_kv_transfer_params(self.extra_args.get("kv_transfer_params"), self.n)
        if self.top_k == 0:
            self.top_k = -1

    @classmethod
    def from_optional(cls, defaults: Optional[Mapping[str, Any]] = None, **fields: Any) -> "SamplingParams":
        """``SamplingParams(**fields)`` where a field that is None takes ``defaults[name]``
        (the model's, see ``ModelConfig.get_diff_sampling_param``), else the class default.

        As vLLM's server builds a request's params: a field the request leaves out, or
        sends as null, takes the model's default. ``LLM.get_default_sampling_params`` is
        ``from_optional(defaults)``.

        Raises:
            ValueError: see the class.
        """
        values = {name: value for name, value in fields.items() if value is not None}
        for name, value in (defaults or {}).items():
            values.setdefault(name, value)
        return cls(**values)

    def _verify(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {getattr(self, field)!r}.")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer from 1 to {MAX_N}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "0 or -1 (disabled), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise bad("seed", "in [-2**63, 2**64)")
        check_max_tokens(self.max_tokens)
        if self.min_tokens < 0:
            raise bad("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})."
            )
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100].")
        check_best_of(self.best_of, self.n)
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or not (k == -1 or k >= 1)):
            raise bad("truncate_prompt_tokens", "-1 (the model's max_model_len) or at least 1")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "a non-empty list of token ids when set")
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words or []):
            raise bad("bad_words", "a list of non-blank strings")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """``bad_words`` as token-id sequences (empty until ``update_from_tokenizer``)."""
        return self._bad_words_token_ids or []

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` into ``bad_words_token_ids`` (the engine's ``Processor``
        calls it). Each word, leading spaces stripped, is encoded alone (the word at the
        start of the output) and after a space (the word inside the text); the second form
        is kept when its first token differs from the first form's and it has as many tokens
        (the rule of vLLM's ``SamplingParams.update_from_tokenizer``).

        Args:
            tokenizer: a Hugging Face tokenizer (``encode(text, add_special_tokens=False)``).
        """
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    def clone(self) -> "SamplingParams":
        """A deep copy (used to give each of the ``n`` completions its own params)."""
        return copy.deepcopy(self)
