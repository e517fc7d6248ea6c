"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints).

``/tokenize`` takes a ``prompt`` (completions form) or ``messages`` (chat form, rendered
with the chat template exactly as ``/v1/chat/completions`` does: the same
``PromptRenderer``) and returns the token ids; ``/detokenize`` turns token ids back into
text. Neither touches the engine, so this class needs no engine: only the model names,
the renderer and two sizes.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.renderer import PromptRenderer
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    """``/tokenize`` and ``/detokenize``.

    Args:
        models: the served model names.
        renderer: tokenizer and chat template (shared with the generating endpoints).
        max_model_len: the context length in tokens (reported by ``/tokenize``).
        vocab_size: token ids ``/detokenize`` accepts are in ``[0, vocab_size)`` (the
            engine's ``Processor.vocab_size``).
    """

    def __init__(self, models: OpenAIServingModels, renderer: PromptRenderer, max_model_len: int, vocab_size: int) -> None:
        self.models = models
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Raises: OpenAIServingError (400 bad template use or options, 404 unknown model)."""
        self.models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.renderer.render_chat(request)
        else:
            text = request.prompt
        param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        token_ids = self.renderer.encode(text, request.add_special_tokens, param)
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
