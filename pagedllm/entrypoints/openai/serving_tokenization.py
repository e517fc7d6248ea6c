"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints).

``/tokenize`` takes a ``prompt`` (completions form) or ``messages`` (chat form, rendered
with the chat template exactly as ``/v1/chat/completions`` does) and returns the token
ids; ``/detokenize`` turns token ids back into text.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import render_chat_prompt
from pagedllm.entrypoints.openai.serving_completion import OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization(OpenAIServing):
    """``/tokenize`` and ``/detokenize``.

    Args:
        chat_template: the server's ``--chat-template`` text, or None for the tokenizer's.
        (others: see ``OpenAIServing``)
    """

    def __init__(
        self,
        engine: Any,
        models: OpenAIServingModels,
        tokenizer: Any,
        *,
        chat_template: Optional[str] = None,
        log_requests: bool = True,
    ) -> None:
        super().__init__(engine, models, tokenizer, log_requests=log_requests)
        self.chat_template = chat_template
        processor = getattr(engine, "processor", None)
        self.vocab_size: int = getattr(processor, "vocab_size", None) or len(tokenizer)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Raises: OpenAIServingError (400 bad template use, 404 unknown model)."""
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = render_chat_prompt(
                self.tokenizer,
                request.messages,
                request.chat_template or self.chat_template,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
        else:
            text = request.prompt
        token_ids = self.encode(text, request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(token_ids)]
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Raises: OpenAIServingError (400 token id outside the vocabulary, 404 unknown model)."""
        self.models.resolve(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"Token id {bad[0]} is out of vocabulary: token ids must be in [0, {self.vocab_size}).",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
