"""Front-end input processing: validate a prompt and its SamplingParams, tokenize, and
build the ``EngineCoreRequest``.

This is the one validation point of a request, for the offline ``LLM`` / ``LLMEngine``
and the OpenAI server (which calls ``resolve_max_tokens`` and ``process`` itself and
hands the finished ``EngineCoreRequest`` to ``AsyncLLM``): the model's default sampling
parameters (``default_sampling_params``, from its generation_config.json), the
``max_tokens`` default and bound (``resolve_max_tokens``) and the context-fit check
(``check_context_fit``, run once, inside ``process``).

Errors here are ``ValueError``s whose messages name the problem; nothing reaches the
engine, so other requests are unaffected.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from transformers import PreTrainedTokenizerBase

from pagedllm.config import GENERATION_CONFIG_MODES, LoRAConfig, ModelConfig, StructuredOutputsConfig
from pagedllm.lora.request import LoRARequest, with_load_generation
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.pooling_params import PoolingParams, encode_token_type_ids
from pagedllm.sampling_params import DEFAULT_MAX_TOKENS, RequestOutputKind, SamplingParams, check_max_tokens
from pagedllm.structured_output.selection import check_structured_outputs

#: A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]},
#: either with an optional "cache_salt"; {"prompt": str, "multi_modal_data": {"image": image or
#: [images], "video": video or [videos]}, "mm_processor_kwargs": {...}} for an image-text model (PIL
#: images; videos as uint8 arrays [T, H, W, 3] or lists of PIL frames); the chat paths
#: pass {"prompt", "prompt_token_ids", "mm_features"} (``Processor.process_multimodal``'s output).
PromptType = Union[str, list[int], dict]


def check_unicode(text: str, what: str = "prompt") -> None:
    """Raises ValueError (naming ``what``) when ``text`` holds a lone UTF-16 surrogate
    (``"\\ud800"``, which JSON and Python strings allow): it is no character, and no
    tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is not a "
                         "character; send valid Unicode text.") from None


def _default_sampling_params(model_config: ModelConfig) -> dict:
    """``model_config.get_diff_sampling_param()``, checked once by ``SamplingParams``.

    Raises:
        ValueError: a value out of range (the message names the file and the field).
    """
    defaults = model_config.get_diff_sampling_param()
    try:
        SamplingParams.from_optional(defaults)
    except ValueError as exc:
        path = model_config.generation_config_dir / "generation_config.json"
        raise ValueError(f"{path} sets an invalid default sampling parameter: {exc}") from None
    return defaults


class ContextLengthError(ValueError):
    """A prompt and its ``max_tokens`` do not fit in ``max_model_len``.

    Attributes:
        num_prompt_tokens: the prompt's length in tokens.
        num_completion_tokens: the ``max_tokens`` asked for (None: the rest of the context).
        max_model_len: the context length in tokens.

    The message is the engine's; the OpenAI server words it as vLLM's server does from
    these attributes.
    """

    def __init__(self, num_prompt_tokens: int, num_completion_tokens: Optional[int], max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = num_completion_tokens
        self.max_model_len = max_model_len
        if num_prompt_tokens >= max_model_len:
            message = (
                f"The prompt is {num_prompt_tokens} tokens long, but this model's maximum context length "
                f"is {max_model_len} tokens (max_model_len), which leaves no room to generate."
            )
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + (num_completion_tokens or 0)} tokens ({num_prompt_tokens} "
                f"in the prompt, {num_completion_tokens} for the completion). Please reduce the prompt "
                f"or max_tokens."
            )
        super().__init__(message)


class PoolingContextLengthError(ContextLengthError):
    """A pooling request's prompt is longer than ``max_model_len`` (it may fill it: nothing is generated)."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(num_prompt_tokens, 0, max_model_len)
        self.args = (
            f"This model's maximum context length is {max_model_len} tokens. However, the input for "
            f"embedding has {num_prompt_tokens} tokens. Please reduce the length of the input.",
        )


class Processor:
    """Turns user prompts into validated ``EngineCoreRequest``s.

    Args:
        model_config: for ``max_model_len``, the vocabulary size and the generation config.
        tokenizer: the model's tokenizer.
        lora_config: with LoRA on (``--enable-lora``), to check requests' adapters.
        structured_outputs_config: the engine's backend choice and options, under which a
            request's ``structured_outputs`` is checked (None: the defaults).
        scheduling_policy: the scheduler's (``SchedulerConfig.policy``): a request's
            ``priority`` other than 0 needs "priority", as vLLM.
        max_num_batched_tokens: the scheduler's: an image-text model's images may fill at most
            the encoder cache (``pagedllm.multimodal.budget``; None: no limit).

    Attributes:
        default_sampling_params: the model's default sampling parameters (field -> value,
            ``ModelConfig.get_diff_sampling_param``): the server fills a request's absent
            or null fields from them (``SamplingParams.from_optional``) and
            ``LLM.get_default_sampling_params`` returns them, as vLLM.
        override_max_tokens: with a ``--generation-config`` folder, its ``max_new_tokens``
            also caps every request's ``max_tokens`` (vLLM's ``override_max_tokens``); else None.

    Raises:
        ValueError: the generation config sets an invalid default.
    """

    def __init__(
        self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, lora_config: Optional[LoRAConfig] = None,
        structured_outputs_config: Optional[StructuredOutputsConfig] = None, scheduling_policy: str = "fcfs",
        max_num_batched_tokens: Optional[int] = None,
    ) -> None:
        self.hf_config = model_config.hf_config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduling_policy = scheduling_policy
        self.model_config = model_config
        self.lora_config = lora_config
        # (adapter path, load generation) of the adapters that passed ``check_lora``.
        self._checked_adapters: set[tuple[str, int]] = set()
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.max_model_len = model_config.max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = min(model_config.vocab_size, len(tokenizer))
        self.max_logprobs = self.vocab_size if model_config.max_logprobs == -1 else model_config.max_logprobs
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        self.extra_eos_token_ids = sorted(model_config.generation_config_eos_ids() - {self.eos_token_id})
        self.default_sampling_params = _default_sampling_params(model_config)
        self._mm_processor = None  # the model's transformers processor, loaded at the first image
        self.override_max_tokens: Optional[int] = (
            None
            if model_config.generation_config in GENERATION_CONFIG_MODES
            else self.default_sampling_params.get("max_tokens")
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, token ids) of a prompt in any accepted form.

        Raises:
            ValueError: for an unsupported prompt type.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A dict prompt needs a 'prompt' or a 'prompt_token_ids' key.")
        if isinstance(prompt, str):
            check_unicode(prompt)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"A prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}."
        )

    def truncate_prompt(self, prompt_token_ids: list[int], truncate_prompt_tokens: Optional[int]) -> list[int]:
        """The last ``truncate_prompt_tokens`` prompt tokens (-1: the last ``max_model_len``;
        None: all of them), as vLLM's ``truncate_prompt_tokens`` (left truncation)."""
        if truncate_prompt_tokens is None:
            return prompt_token_ids
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return prompt_token_ids[-keep:]

    def resolve_max_tokens(
        self,
        num_prompt_tokens: int,
        max_tokens: Optional[int],
        default: Optional[int] = DEFAULT_MAX_TOKENS,
        field: str = "max_tokens",
    ) -> int:
        """The ``max_tokens`` of a request whose ``field`` is ``max_tokens`` (None: unset).

        Unset takes ``default``; a ``default`` of None means the model's default
        (``max_new_tokens`` of its generation config), else the rest of the context. It is
        cut to the room the prompt leaves; when the prompt leaves none, it is that default
        (or 1), so that ``check_context_fit`` reports the request. An explicit value is
        kept (the fit check reports one that does not fit). Either is capped by
        ``override_max_tokens`` when set. As vLLM's ``get_max_tokens``.

        Raises:
            ValueError: an explicit value below 1 (the message names ``field``).
        """
        check_max_tokens(max_tokens, field)
        if max_tokens is None:
            if default is None:
                default = self.default_sampling_params.get("max_tokens")
            room = self.max_model_len - num_prompt_tokens
            if room < 1:
                max_tokens = default or 1
            else:
                max_tokens = room if default is None else min(default, room)
        if self.override_max_tokens is not None:
            max_tokens = min(max_tokens, self.override_max_tokens)
        return max_tokens

    def max_tokens_limit(self, num_prompt_tokens: int, max_tokens: Optional[int]) -> int:
        """The most tokens a request may generate: ``max_tokens``, or (None) the rest of
        the context."""
        return max_tokens if max_tokens is not None else self.max_model_len - num_prompt_tokens

    def check_context_fit(self, num_prompt_tokens: int, max_tokens: Optional[int]) -> None:
        """The prompt leaves room to generate, and prompt + ``max_tokens`` (when set) fits
        in ``max_model_len``.

        Raises:
            ContextLengthError: it does not fit (the message gives the numbers and the limit).
        """
        if num_prompt_tokens >= self.max_model_len or (
            max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len
        ):
            raise ContextLengthError(num_prompt_tokens, max_tokens, self.max_model_len)

    def check_prompt_tokens(self, prompt_token_ids: list[int]) -> None:
        """The prompt has a token, and every one is in the vocabulary.

        Raises:
            ValueError: an empty prompt, or an out-of-vocabulary token id.
        """
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of vocabulary: token ids must be in [0, {self.vocab_size})."
            )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check the prompt against the vocabulary and the context length.

        Raises:
            ValueError: empty prompt, out-of-vocabulary token id, stop token id or
                ``logit_bias`` key, ``allowed_token_ids`` or ``bad_words`` token outside
                the vocabulary; more ``logprobs`` or
                ``prompt_logprobs`` than ``max_logprobs`` (vLLM's message); a
                ``structured_outputs`` constraint that no allowed backend compiles
                ("Invalid structured outputs <kind>: <the backend's message>").
            ContextLengthError: see ``check_context_fit``.
        """
        self.check_prompt_tokens(prompt_token_ids)
        self.check_context_fit(len(prompt_token_ids), params.max_tokens)
        bad_stop = [t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids contains {bad_stop[0]}, outside [0, {self.vocab_size}).")
        bad_bias = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias has token id {bad_bias[0]}, outside [0, {self.vocab_size}).")
        for field, token_ids in (
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
        ):
            outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(f"{field} has token id {outside[0]}, outside [0, {self.vocab_size}).")
        for kind, num_logprobs in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if num_logprobs is not None and num_logprobs > self.max_logprobs:
                raise ValueError(
                    f"Requested {kind} logprobs of {num_logprobs}, which is greater than max allowed: "
                    f"{self.max_logprobs} (--max-logprobs)."
                )
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs, self.structured_outputs_config)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and tokenize; returns the engine request and the prompt text (if any).
        ``priority``: its place under the priority scheduling policy (lower runs first).

        Raises:
            ValueError: see ``tokenize_prompt``, ``validate`` and ``check_lora``; a
                ``priority`` other than 0 without the priority policy (vLLM's message).
            FileNotFoundError: see ``check_lora``.
        """
        if self.model_config.runner_type == "pooling":
            raise ValueError(f"{self.model_config.model} is a pooling model (--runner pooling) for the "
                             f"{' / '.join(self.model_config.pooling_tasks)} task(s) (LLM.embed, LLM.classify, "
                             "LLM.score; /v1/embeddings, /classify, /v1/score): it generates no text.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled "
                             "(--scheduling-policy priority).")
        mm_inputs = self.process_multimodal(prompt)
        mm_features = prompt.get("mm_features") if isinstance(prompt, dict) else None
        if mm_features is not None:
            self._check_takes_images()
        if mm_inputs is None:
            prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        else:
            prompt_text, prompt_token_ids, mm_features = mm_inputs
        if mm_features and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported with images (it would cut their "
                             "placeholder tokens).")
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens)
        if params.bad_words and not params.bad_words_token_ids:
            params = params.clone()
            params.update_from_tokenizer(self.tokenizer)
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            lora_request = self.check_lora(lora_request)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string.")
        extra_stops = [t for t in self.extra_eos_token_ids if t not in (params.stop_token_ids or [])]
        if extra_stops and not params.ignore_eos:
            # As vLLM: generation_config.json's other EOS ids end generation like stop token ids.
            params = params.clone()
            params.stop_token_ids = [*(params.stop_token_ids or []), *extra_stops]
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            cache_salt=cache_salt,
            lora_request=lora_request,
            mm_features=mm_features,
            priority=priority,
        )
        return request, prompt_text

    def _check_takes_images(self) -> str:
        """The model's architecture, an image-text one.

        Raises:
            ValueError: a text-only model.
        """
        from pagedllm.multimodal.processing import MULTIMODAL_LAYOUTS

        architecture = self.model_config.architecture
        if architecture not in MULTIMODAL_LAYOUTS:
            raise ValueError(f"{self.model_config.model} ({architecture}) is a text-only model: it does not take images.")
        return architecture

    def process_multimodal(self, prompt: PromptType, add_special_tokens: bool = True
                           ) -> Optional[tuple[str, list[int], list]]:
        """(prompt text, token ids, ``MultiModalFeatureSpec`` per item) of a dict prompt with
        ``multi_modal_data`` (``{"image": PIL image(s), "video": video(s)}``, a video as
        ``pagedllm.multimodal.video.as_video`` takes it), through the model's own processor
        (``pagedllm.multimodal.processing``; ``add_special_tokens`` for its tokenizer: False for a
        rendered chat, whose template writes them); None for a prompt without it. The chat
        paths pass the result on as ``{"prompt", "prompt_token_ids", "mm_features"}``.

        Raises:
            ValueError: the model takes no images (videos); a modality other than "image" /
                "video"; more items than ``--limit-mm-per-prompt``; ``mm_processor_kwargs``
                without ``--trust-request-mm-kwargs``; a prompt given as token ids; an item that
                is not an image (video); what the processor refuses (the message says which).
        """
        if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
            return None
        from pagedllm.multimodal.video import as_video
        from PIL import Image

        architecture = self._check_takes_images()
        processor = self._multimodal_processor(architecture)
        data = prompt["multi_modal_data"]
        modalities = ("image", "video") if processor.takes_videos else ("image",)
        unknown = sorted(set(data) - set(modalities))
        if unknown:
            raise ValueError(f"multi_modal_data: unknown modality {unknown[0]!r} ({architecture} takes "
                             f"{' and '.join(repr(m) for m in modalities)}).")
        images = self._items(data, "image")
        videos = self._items(data, "video")
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data image {i} is a {type(image).__name__}, not a PIL image.")
        try:
            videos = [as_video(video) for video in videos]
        except ValueError as exc:
            raise ValueError(f"multi_modal_data video: {exc}.") from None
        kwargs = prompt.get("mm_processor_kwargs")
        if kwargs and not self.model_config.multimodal_config.trust_request_mm_kwargs:
            raise ValueError("mm_processor_kwargs in a request are refused: the server was not started with "
                             "--trust-request-mm-kwargs.")
        if "prompt" not in prompt or not isinstance(prompt["prompt"], str):
            raise ValueError("A prompt with multi_modal_data needs its text in 'prompt' (the processor places the "
                             "images' tokens).")
        token_ids, features = processor.apply(prompt["prompt"], images, kwargs, add_special_tokens, videos)
        return prompt["prompt"], token_ids, features

    def _items(self, data: dict, modality: str) -> list:
        """``data[modality]`` as a list of items: one item or a list of them (for "video", a
        list of PIL images is one video, its frames).

        Raises:
            ValueError: more than ``--limit-mm-per-prompt`` allows."""
        from PIL import Image

        value = data.get(modality)
        if value is None:
            items = []
        elif not isinstance(value, list):
            items = [value]
        elif modality == "video" and value and isinstance(value[0], Image.Image):
            items = [value]
        else:
            items = value
        limit = self.model_config.multimodal_config.limit_per_prompt.get(modality)
        if limit is not None and len(items) > limit:
            raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt (--limit-mm-per-prompt); "
                             f"this one has {len(items)}.")
        return items

    def _multimodal_processor(self, architecture: str) -> Any:
        """The model's ``MultiModalProcessor``, built on first use."""
        from pagedllm.multimodal.budget import encoder_cache_size
        from pagedllm.multimodal.processing import MultiModalProcessor

        if self._mm_processor is None:
            mm_config = self.model_config.multimodal_config
            cache_size = (encoder_cache_size(self.hf_config, self.max_num_batched_tokens, self.model_config.model_dir,
                                             mm_config.mm_processor_kwargs)
                          if self.max_num_batched_tokens is not None else None)
            self._mm_processor = MultiModalProcessor(
                self.model_config.model_path, architecture, self.hf_config, self.model_config.trust_remote_code,
                mm_config.mm_processor_kwargs, cache_size)
        return self._mm_processor

    def process_pooling(
        self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: Optional[float] = None,
    ) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and tokenize a pooling request (``params`` resolved by ``PoolingParams.verify``);
        returns the engine request and the prompt text (if any). The prompt may fill ``max_model_len``.

        A dict prompt's ``token_type_ids`` (vLLM's ``TokensPrompt`` field; a pair's segments) are
        packed into its token ids (``pagedllm.pooling_params.encode_token_type_ids``).

        Raises:
            ValueError: the model is not a pooling model; see ``tokenize_prompt`` and ``PoolingParams.verify``;
                an empty prompt or an out-of-vocabulary token id; ``token_type_ids`` that do not fit.
            PoolingContextLengthError: a prompt longer than ``max_model_len`` (after truncation).
        """
        if self.model_config.runner_type != "pooling":
            raise ValueError(f"{self.model_config.model} is a generative model: it computes no embeddings "
                             "(serve an embedding model, or this one with --convert embed).")
        params = params.verify(self.model_config)
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        prompt_token_ids = self.truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens)
        if len(prompt_token_ids) > self.max_model_len:
            raise PoolingContextLengthError(len(prompt_token_ids), self.max_model_len)
        self.check_prompt_tokens(prompt_token_ids)
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if token_type_ids is not None:  # a cross-encoder's pair: its types travel inside the ids
            token_type_ids = self.truncate_prompt(list(token_type_ids), params.truncate_prompt_tokens)
            prompt_token_ids = encode_token_type_ids(prompt_token_ids, token_type_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
            eos_token_id=None,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            pooling_params=params,
        )
        return request, prompt_text

    def check_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """``lora_request`` with its ``load_generation`` set, after checking the adapter
        against the model once per version of its weight file (``pagedllm.lora.peft_config``).

        Raises:
            ValueError: LoRA is off, or the adapter does not fit (the message says why).
            FileNotFoundError: no adapter at its path.
        """
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                             "(enable_lora=True / --enable-lora).")
        from pagedllm.lora.peft_config import check_adapter

        stamped = with_load_generation(lora_request)
        version = (stamped.lora_path, stamped.load_generation)
        if version not in self._checked_adapters:
            check_adapter(stamped.lora_path, self.hf_config, self.lora_config.max_lora_rank)
            self._checked_adapters.add(version)
        return stamped
