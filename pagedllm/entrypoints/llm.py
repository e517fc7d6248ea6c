"""``LLM``: offline batch inference, as vLLM's ``LLM`` class."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from typing import Any, Optional, Sequence, Union

import msgspec
from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.chat_content_format import resolve_content_format, template_text
from pagedllm.entrypoints.chat_utils import (
    apply_chat_template,
    render_media_chat,
    image_placeholder,
    video_placeholder,
    load_chat_images,
    media_connector,
    multimodal_chat_prompt,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.entrypoints.score_utils import check_cross_encoder, cosine_similarity, score_pairs, score_prompts
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams, decode_token_ids
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]

#: ``LLM`` keywords: ``EngineArgs``' fields but ``model`` (a parameter of its own) and
#: ``usage_context`` (always "llm" here).
_ENGINE_KEYWORDS = tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name not in ("model", "usage_context"))


def _check_keywords(kwargs: dict[str, Any]) -> None:
    """Raises TypeError for a keyword ``LLM`` does not take, naming the closest one."""
    for name in kwargs:
        if name not in _ENGINE_KEYWORDS:
            close = difflib.get_close_matches(name, _ENGINE_KEYWORDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    Args (vLLM's names and defaults):
        model: a Hugging Face directory or a Hub id (downloaded on first use, as vLLM:
            ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are honoured); None loads
            the small model that ships with pagedllm.
        **kwargs: any ``EngineArgs`` field (the one list of them), e.g.
            tokenizer: tokenizer directory or Hub id (default: the model's).
            revision / tokenizer_revision: Hub branch, tag or commit (default: main).
            download_dir: where downloads go (default: the Hugging Face cache).
            quantization: "int8" quantizes the weights at load (weight-only, per-channel
                scales); None keeps the checkpoint's own format.
            quantization_config: options of a quantization applied at load, e.g.
                ``{"group_size": 128}`` for "int4" (default 32).
            dtype: "auto", "float32", "bfloat16" or "float16".
            max_model_len: context length in tokens (default: the model's).
            block_size: tokens per KV-cache block (8, 16 or 32).
            max_num_seqs: most requests running at once.
            max_num_batched_tokens: token budget of one step (default 4096 on CPU, 16384 on GPU).
            kv_cache_memory_bytes: exact KV-cache size; overrides gpu_memory_utilization.
            gpu_memory_utilization: fraction of device memory (CPU: available RAM) to use.
            seed: global random seed.
            enable_prefix_caching: automatic prefix caching (on by default).
            prefix_caching_hash_algo: "sha256", "sha256_cbor" or "xxhash".
            attention_backend: "CPU_ATTN", "TORCH_SDPA" or another registered name (default:
                $PAGEDLLM_ATTENTION_BACKEND, else chosen by platform).
            generation_config: "auto" (the model's generation_config.json sets the default
                sampling parameters: ``get_default_sampling_params``), "vllm" (vLLM's
                defaults), or a folder with a generation_config.json.
            structured_outputs_config: constrained decoding options, e.g.
                ``{"backend": "auto" | "xgrammar" | "guidance", "disable_any_whitespace": True}``
                (``pagedllm.config.StructuredOutputsConfig``; requests set
                ``SamplingParams(structured_outputs=...)``).
            disable_log_stats: no periodic stats line while generating (True by default, as
                vLLM's ``LLM``; False logs it every ``$PAGEDLLM_LOG_STATS_INTERVAL`` s, default 10).
            tensor_parallel_size: worker processes the model is split over (tensor
                parallelism; ``MultiprocExecutor`` above 1).
            runner / convert / pooler_config: a pooling model (``embed``, ``encode``, ``classify``,
                ``score``): "auto" takes an encoder (``BertModel`` ...) or a ``*ForSequenceClassification``
                as one; ``convert="embed"`` / ``"classify"`` a decoder checkpoint;
                ``pooler_config={"pooling_type": "MEAN", "normalize": True}`` (see ``EngineArgs``).
            max_logprobs, num_gpu_blocks_override, trust_remote_code, enforce_eager
                (no-op) ...: vLLM's other arguments, see ``EngineArgs``.

    Raises:
        TypeError: a keyword that is not an ``EngineArgs`` field (the message suggests the
            closest one).
        ValueError: for bad arguments, a value not supported yet (e.g.
            ``kv_cache_dtype='fp8'``), a tensor-parallel size that does not split the
            model's heads, more pipeline stages than layers, more workers than cores / GPUs,
            an unsupported architecture or a KV
            budget that cannot hold one ``max_model_len`` sequence.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        _check_keywords(kwargs)
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default (the server logs stats)
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's default ``SamplingParams`` (vLLM's method): what its generation config
        sets (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``max_new_tokens`` as ``max_tokens``), vLLM's defaults for the rest; plain
        ``SamplingParams()`` with ``generation_config="vllm"``. ``generate`` and ``chat``
        use it when given no ``sampling_params``."""
        return SamplingParams.from_optional(self.llm_engine.processor.default_sampling_params)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
        *,
        prompt_token_ids: Union[list[int], list[list[int]], None] = None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns one ``RequestOutput`` per prompt,
        in input order.

        ``prompts`` is one prompt or a list: strings, token-id lists, or vLLM's dicts
        (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``; for an image-text model
        ``{"prompt": "... <image> ...", "multi_modal_data": {"image": PIL image or a list}}``, with
        ``"mm_processor_kwargs"`` under ``trust_request_mm_kwargs``). ``prompt_token_ids`` is
        vLLM's older keyword: one token-id list or a list of them, instead of ``prompts``
        (or with them, one per prompt: the text is then kept as the prompt's text).
        ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt;
        None means ``get_default_sampling_params()`` (as vLLM). ``lora_request``: one
        ``LoRARequest`` for all prompts or one per prompt (None in a list: the base model);
        needs ``enable_lora=True``. ``priority`` (vLLM's): one per prompt, with
        ``scheduling_policy="priority"``; lower runs first (default 0).

        Raises:
            ValueError: for a bad prompt, parameters or LoRA adapter, a ``priority`` list
                of another length or without the priority policy, neither ``prompts``
                nor ``prompt_token_ids``, or both of different lengths; no request of this
                call is left in the engine.
            FileNotFoundError: no LoRA adapter at a ``lora_path``.
        """
        prompt_list = self._as_prompt_list(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        lora_list = self._as_lora_list(lora_request, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} values for {len(prompt_list)} prompts.")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        request_ids = []
        try:
            for prompt, params, lora, prio in zip(prompt_list, params_list, lora_list, priorities):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, params, lora_request=lora, priority=prio)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Union[ChatMessages, Sequence[ChatMessages]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        tokenizer's chat template (or ``chat_template``); the other arguments as
        ``generate``'s, in vLLM's order. A message's ``content`` is a string or OpenAI's
        text parts (``[{"type": "text", "text": ...}]``), handed to the template in
        ``chat_template_content_format`` (vLLM's: "string" joins the parts with newlines,
        "openai" gives every content as a list of parts, "auto" the one the template takes:
        ``chat_content_format.detect_content_format``), and for an
        image-text model ``image_url`` parts (``data:`` / ``file://`` / ``http(s)://`` URLs, see
        ``chat_utils.conversation_images``) or ``{"type": "image_pil", "image_pil": image}``. ``tools``
        (OpenAI's function definitions) reach the template as its ``tools`` variable, as in
        vLLM.

        Raises:
            ValueError: if the tokenizer has no chat template and none is given, if
                ``continue_final_message`` is set without ``add_generation_prompt=False``
                (``chat_utils.resolve_chat_options``, as vLLM), for a content part that is
                neither text nor (on an image-text model) an image, an image that cannot be
                loaded ("messages[i].content[j]: <why>"), an unknown
                ``chat_template_content_format``, or as ``generate``.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        model_config = self.llm_engine.config.model_config
        placeholder = image_placeholder(model_config, tokenizer)
        video_text = video_placeholder(model_config)
        template_format = resolve_content_format(chat_template_content_format,
                                                 template_text(tokenizer, chat_template, tools))
        token_prompts = []
        for conversation in conversations:
            def render(messages: list[dict[str, Any]], keep_parts: bool) -> str:
                return apply_chat_template(tokenizer, messages, chat_template, add_generation_prompt,
                                           continue_final_message, chat_template_kwargs, tools, keep_parts)

            text, images = render_media_chat(render, conversation, placeholder, video_text,
                                             chat_template_content_format, template_format)
            if images:
                loaded = load_chat_images(images, media_connector(model_config),
                                          model_config.multimodal_config.video_num_frames)
                token_prompts.append(multimodal_chat_prompt(self.llm_engine.processor, text, loaded))
            else:
                token_prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(token_prompts, sampling_params, use_tqdm, lora_request)

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        use_tqdm: bool = True,
        *,
        pooling_task: str = "embed",
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt on a pooling model (vLLM's ``LLM.encode``); one
        ``PoolingRequestOutput`` per prompt, in input order. ``prompts`` as ``generate``'s;
        ``pooling_params``: one for all prompts or one per prompt (None: the defaults), its
        ``task`` set to ``pooling_task``; ``truncate_prompt_tokens`` (when given) to each.

        Raises:
            ValueError: a generative model (``--runner generate``), a bad prompt or
                parameters (``PoolingParams.verify``), a prompt longer than max_model_len;
                no request of this call is left in the engine.
        """
        prompt_list = self._as_list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        params_list = [params] * len(prompt_list) if isinstance(params, PoolingParams) else list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"Got {len(params_list)} PoolingParams for {len(prompt_list)} prompts; "
                             "pass one, or one per prompt.")
        request_ids = []
        try:
            for prompt, one in zip(prompt_list, params_list):
                one = msgspec.structs.replace(one, task=pooling_task)
                if truncate_prompt_tokens is not None:
                    one = msgspec.structs.replace(one, truncate_prompt_tokens=truncate_prompt_tokens)
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, one)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (vLLM's ``LLM.embed``: ``encode`` with the "embed" task),
        each ``outputs.embedding``; raises as ``encode``."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed",
                              truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        use_tqdm: bool = True,
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's ``LLM.classify``: ``encode`` with the
        "classify" task), each ``outputs.probs`` (``id2label`` order; softmax, or sigmoid for
        one label or multi-label models); raises as ``encode``, and for a model that is not a
        classifier."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        text_1: Union[str, Sequence[str]],
        text_2: Union[str, Sequence[str]],
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[PoolingParams] = None,
        chat_template: Optional[str] = None,
    ) -> list[ScoringRequestOutput]:
        """The score of each (text_1, text_2) pair (vLLM's ``LLM.score``; pairs as
        ``score_pairs``: 1:1, 1:N, N:N), each ``outputs.score``, in pair order. A sequence
        classifier (one label) scores each pair as one input (``chat_template``: a score
        template over the query / document messages, e.g. Qwen3-Reranker's); an embedding
        model returns the cosine similarity of the two texts' embeddings
        (``pagedllm.entrypoints.score_utils``).

        Raises:
            ValueError: as ``score_pairs`` and ``encode``; a classifier with more than one label.
        """
        pairs = score_pairs(text_1, text_2)
        model_config = self.llm_engine.model_config
        if not model_config.is_classifier:
            return self._embedding_score(pairs, truncate_prompt_tokens, use_tqdm, pooling_params)
        check_cross_encoder(model_config)
        prompts = score_prompts(model_config, self.get_tokenizer(), pairs, truncate_prompt_tokens, chat_template)
        outputs = self.encode(prompts, pooling_params, use_tqdm, pooling_task="score")
        return [ScoringRequestOutput(out.request_id, ScoringOutput(out.outputs.data[0]),
                                     decode_token_ids(out.prompt_token_ids)) for out in outputs]

    def _embedding_score(self, pairs: list[tuple[str, str]], truncate_prompt_tokens: Optional[int],
                         use_tqdm: bool, pooling_params: Optional[PoolingParams]) -> list[ScoringRequestOutput]:
        """Bi-encoder scores: each distinct text embedded once, each pair the cosine of its two."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = dict(zip(texts, self.encode(texts, pooling_params, use_tqdm, pooling_task="embed",
                                               truncate_prompt_tokens=truncate_prompt_tokens)))
        results = []
        for a, b in pairs:
            first, second = embedded[a], embedded[b]
            score = cosine_similarity(first.outputs.data, second.outputs.data)
            results.append(ScoringRequestOutput(f"{first.request_id}_{second.request_id}", ScoringOutput(score),
                                                first.prompt_token_ids + second.prompt_token_ids))
        return results

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (see ``LLMEngine.reset_prefix_cache``)."""
        self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: free the KV cache and take the weights out of memory (level 1:
        into a file, level 2: dropped), until ``wake_up``; needs ``enable_sleep_mode=True``
        (see ``EngineCore.sleep``)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """vLLM's ``LLM.wake_up``: put back ``tags`` (``"weights"``, ``"kv_cache"``; None: both)."""
        self.llm_engine.wake_up(tags)

    @classmethod
    def _as_prompt_list(
        cls, prompts: Union[PromptType, Sequence[PromptType], None], prompt_token_ids: Optional[list] = None
    ) -> list[PromptType]:
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("generate() needs prompts (or prompt_token_ids).")
            return cls._as_list(prompts)
        id_lists = cls._as_list(prompt_token_ids)
        if prompts is None:
            return [{"prompt_token_ids": ids} for ids in id_lists]
        texts = cls._as_list(prompts)
        if len(texts) != len(id_lists):
            raise ValueError(f"Got {len(texts)} prompts and {len(id_lists)} prompt_token_ids; they must pair up.")
        return [{"prompt": text, "prompt_token_ids": ids} for text, ids in zip(texts, id_lists)]

    @staticmethod
    def _as_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]  # one token-id prompt
        return prompts

    @staticmethod
    def _as_params_list(
        sampling_params: Union[SamplingParams, Sequence[SamplingParams]], num_prompts: int
    ) -> list[SamplingParams]:
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"Got {len(params)} SamplingParams for {num_prompts} prompts; pass one, or one per prompt."
            )
        return params

    @staticmethod
    def _as_lora_list(
        lora_request: Union[LoRARequest, Sequence[LoRARequest], None], num_prompts: int
    ) -> list[Optional[LoRARequest]]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"Got {len(loras)} LoRA requests for {num_prompts} prompts; pass one, or one per prompt.")
        return loras

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        speed = _TokenSpeed(bar)
        while len(results) < len(wanted) and self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
                    speed.add(output)
                    bar.update(1)
        bar.close()
        return [results[r] for r in request_ids]


class _TokenSpeed:
    """Shows the prompt and generated tokens per second of finished requests on a progress
    bar, as vLLM's: ``est. speed input: 1234.56 toks/s, output: 78.90 toks/s`` (tokens over
    the bar's elapsed seconds)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.num_input_tokens = 0
        self.num_output_tokens = 0
        self._show(0.0, 0.0)

    def add(self, output: Union[RequestOutput, PoolingRequestOutput]) -> None:
        self.num_input_tokens += len(output.prompt_token_ids or ())
        if isinstance(output, RequestOutput):
            self.num_output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        if self.bar.disable:
            return
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self._show(self.num_input_tokens / elapsed, self.num_output_tokens / elapsed)

    def _show(self, input_speed: float, output_speed: float) -> None:
        self.bar.postfix = f"est. speed input: {input_speed:.2f} toks/s, output: {output_speed:.2f} toks/s"
