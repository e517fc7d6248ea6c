"""Front-end input processing: validate a prompt and its SamplingParams, tokenize, and
build the ``EngineCoreRequest``.

Errors here are ``ValueError``s whose messages name the problem; nothing reaches the
engine, so other requests are unaffected.
"""

from __future__ import annotations

import time
from typing import Optional, Union

from transformers import GenerationConfig, PreTrainedTokenizerBase

from pagedllm.config import ModelConfig
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

#: A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]},
#: either with an optional "cache_salt".
PromptType = Union[str, list[int], dict]


def _generation_config_eos_ids(model_config: ModelConfig) -> set[int]:
    """The ``eos_token_id`` entries of generation_config.json (an int or a list), if any."""
    try:
        generation_config = GenerationConfig.from_pretrained(model_config.model_path)
    except OSError:
        return set()
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


class Processor:
    """Turns user prompts into validated ``EngineCoreRequest``s.

    Args:
        model_config: for ``max_model_len`` and the vocabulary size.
        tokenizer: the model's tokenizer.
    """

    def __init__(self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.max_model_len = model_config.max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = min(model_config.vocab_size, len(tokenizer))
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        self.extra_eos_token_ids = sorted(_generation_config_eos_ids(model_config) - {self.eos_token_id})

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
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"A prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}."
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check the prompt against the vocabulary and the context length.

        Raises:
            ValueError: empty prompt, out-of-vocabulary token id, prompt that does not fit,
                or prompt + max_tokens over max_model_len (message gives both numbers and
                the limit).
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of vocabulary: token ids must be in [0, {self.vocab_size})."
            )
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"The prompt is {num_prompt} tokens long, but this model's maximum context length "
                f"is {self.max_model_len} tokens (max_model_len), which leaves no room to generate."
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens."
            )
        bad_stop = [t for t in params.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids contains {bad_stop[0]}, outside [0, {self.vocab_size}).")
        bad_bias = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias has token id {bad_bias[0]}, outside [0, {self.vocab_size}).")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and tokenize; returns the engine request and the prompt text (if any).

        Raises:
            ValueError: see ``tokenize_prompt`` and ``validate``.
        """
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        self.validate(prompt_token_ids, params)
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
        )
        return request, prompt_text
