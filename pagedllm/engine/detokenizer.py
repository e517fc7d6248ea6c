"""Incremental detokenization and stop strings (front end, per request).

Stop strings are matched here, on text, not in the EngineCore: the engine stops only on
EOS, stop token ids and lengths; when a stop string matches, the front end finishes the
request and tells the engine to abort it (as vLLM V1).

The decoding method is vLLM's ``detokenize_incrementally`` (prefix_offset/read_offset):
each new token is decoded together with a few tokens before it, and only the suffix that
the new token added is emitted, and only once it no longer ends in U+FFFD (an incomplete
UTF-8 character, e.g. the first byte-level token of an emoji). Tokens are turned into text
with the tokenizer's ``convert_tokens_to_string``, so the result equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE tokenizers.

::

    tokens:   ...  t3   t4   t5 | t6   t7  (new)
                   ^prefix_offset ^read_offset
    prefix_text = text(t3..t5)          new_text = text(t3..t7)
    emit new_text[len(prefix_text):]    unless it ends in U+FFFD (then wait)
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union

from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.tokenizer import byte_level_char_to_byte

#: Tokens of context decoded before the first unread token (vLLM uses 5 as well).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _TokenizerInfo:
    """Per-tokenizer facts that are costly to ask HF for on every request."""

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = len(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.special_tokens = frozenset(tokenizer.all_special_tokens)
        self.added_tokens = frozenset(tokenizer.get_added_vocab())
        self.is_fast = bool(getattr(tokenizer, "is_fast", False))
        #: id -> bytes, for fast tokenizers whose decoder is exactly byte-level (else None).
        self.token_bytes = _byte_level_table(tokenizer) if self.is_fast else None


def _byte_level_table(tokenizer: Any) -> Optional[list[bytes]]:
    """Each id's bytes when the fast tokenizer's decoder is a lone ``ByteLevel`` (GPT-2,
    Llama 3, Qwen...): decoding is then the concatenation of these, read as UTF-8 with
    U+FFFD for invalid bytes. A token with a character outside the byte map (an added
    token's plain text) stands for its own UTF-8 bytes, as in the tokenizers library's
    ``ByteLevel`` decoder. None for any other decoder."""
    try:
        from tokenizers import decoders

        decoder = tokenizer.backend_tokenizer.decoder
    except (AttributeError, ImportError):
        return None
    if not isinstance(decoder, decoders.ByteLevel):
        return None
    char_to_byte = byte_level_char_to_byte()
    table: list[bytes] = []
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        token = token or ""
        try:
            table.append(bytes(char_to_byte[c] for c in token))
        except KeyError:
            table.append(token.encode("utf-8"))
    return table


_INFO_CACHE: "weakref.WeakKeyDictionary[Any, _TokenizerInfo]" = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    """Cached per tokenizer, computed on first use (tokens added later are not seen)."""
    try:
        info = _INFO_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable
        return _TokenizerInfo(tokenizer)
    if info is None:
        info = _INFO_CACHE[tokenizer] = _TokenizerInfo(tokenizer)
    return info


class _WindowDecoder:
    """Token-by-token text of one sequence, never ending in half a UTF-8 character.

    Args:
        tokenizer: a HF tokenizer (fast or slow).
        prompt_token_ids: the prompt; its last tokens are decoding context only (so that
            a tokenizer that drops a leading space at the start of a text does not drop
            the space of the first generated word).
        skip_special_tokens: drop special tokens, as ``tokenizer.decode``.
        spaces_between_special_tokens: for slow tokenizers, join added tokens and the
            text between them with spaces (HF slow ``decode`` semantics). Fast tokenizers
            ignore it, as HF fast ``decode`` does.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = _tokenizer_info(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # NOTE: as vLLM, 2 extra prompt tokens are converted so that a skipped special
        # token at the end of the prompt still leaves enough context.
        context = prompt_token_ids[-(_CONTEXT_TOKENS + 2):]
        self.tokens: list[str] = [t for i in context if (t := self._to_token(i)) is not None]
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    def _to_token(self, token_id: int) -> Optional[str]:
        """The token string of an id; None when it is skipped."""
        if self.skip_special_tokens and token_id in self.info.special_ids:
            return None
        if not 0 <= token_id < self.info.vocab_size:
            return ""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        return "" if token is None else token

    def _to_string(self, tokens: list[str]) -> str:
        info = self.info
        if info.is_fast or not info.added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizer with added tokens: added tokens are not run through the
        # tokenizer's decoder (vLLM's _convert_tokens_to_string_with_added_encoders).
        sub_texts: list[str] = []
        current: list[str] = []
        for token in tokens:
            if self.skip_special_tokens and token in info.special_tokens:
                continue
            if token in info.added_tokens:
                if current:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(token)
            else:
                current.append(token)
        if current:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)

    def decode_next(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be "")."""
        token = self._to_token(token_id)
        if token is None:
            return ""
        self.tokens.append(token)
        return self._advance(flush=False)

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        if self.read_offset >= len(self.tokens):
            return ""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        prefix_text = self._to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._to_string(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text):
            if flush:
                self.prefix_offset = self.read_offset = len(self.tokens)
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text):]


def _incomplete_tail(data: bytes) -> int:
    """Where the UTF-8 character cut off at the end of ``data`` starts (len(data) if none)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character's lead
            needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return len(data) - back if needed > back else len(data)
    return len(data)


class _ByteLevelDecoder:
    """``_WindowDecoder``'s results for byte-level BPE tokenizers, without re-decoding a
    window per token: each token appends its bytes; the text of all complete UTF-8
    characters is emitted, an incomplete one at the end waits (as U+FFFD when flushed).
    Same text as ``tokenizer.decode``: the tokenizers library also joins the bytes and
    decodes them with U+FFFD for invalid sequences (Python's and Rust's replacement rules
    are both the Unicode "maximal subpart" practice).

    Args:
        info: the tokenizer's facts, with ``token_bytes`` set.
        skip_special_tokens: drop special tokens, as ``tokenizer.decode``.
    """

    def __init__(self, info: _TokenizerInfo, skip_special_tokens: bool) -> None:
        assert info.token_bytes is not None
        self.token_bytes = info.token_bytes
        self.skip_ids = info.special_ids if skip_special_tokens else frozenset()
        self.pending = b""

    def decode_next(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be "")."""
        if token_id in self.skip_ids or not 0 <= token_id < len(self.token_bytes):
            return ""
        data = self.pending + self.token_bytes[token_id]
        cut = _incomplete_tail(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", "replace")

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        data, self.pending = self.pending, b""
        return data.decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Generated text of one request, built token by token, with stop strings.

    Args:
        tokenizer: a HF tokenizer, or None (then no text is produced).
        request: the request; its ``sampling_params`` give ``stop``, ``min_tokens``,
            ``include_stop_str_in_output``, ``detokenize``, ``skip_special_tokens`` and
            ``spaces_between_special_tokens``.

    Attributes:
        output_text: the text so far (truncated at a matched stop string).
        output_token_ids: the generated token ids accepted so far. Tokens that arrive in
            the same ``update`` after the token that completed a stop string are dropped.

    Raises:
        ValueError: if stop strings are set but there is no text (``detokenize=False`` or
            no tokenizer).
    """

    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_string: Optional[str] = None
        self._last_output_text_offset = 0
        self._decoder: Union[_WindowDecoder, _ByteLevelDecoder, None] = None
        if tokenizer is not None and params.detokenize:
            info = _tokenizer_info(tokenizer)
            if info.token_bytes is not None:
                self._decoder = _ByteLevelDecoder(info, params.skip_special_tokens)
            else:
                self._decoder = _WindowDecoder(
                    tokenizer,
                    request.prompt_token_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
        elif self.stop:
            raise ValueError("stop strings need detokenization (detokenize=True and a tokenizer).")
        # NOTE: with include_stop_str_in_output the text is cut after the stop string,
        # and all text emitted before the match lies before that, so nothing is held.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

    def update(
        self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False
    ) -> Optional[str]:
        """Append the tokens of one engine step and look for stop strings.

        Args:
            new_token_ids: tokens generated this step.
            stop_terminated: the engine finished the request on the last of these tokens
                (EOS or a stop token id); that token's text is then left out unless
                ``include_stop_str_in_output`` (vLLM semantics). It stays in
                ``output_token_ids``.
            finished: the request ends with this step; text held back for an incomplete
                UTF-8 character is then flushed (as U+FFFD), so ``output_text`` equals
                the full decode.

        Returns:
            The stop string that matched, or None. ``output_text`` is then cut before it
            (or after it with ``include_stop_str_in_output``), also when the match lies in
            the middle of a token's text. Stop strings are checked only on text of tokens
            after the first ``min_tokens`` ones (a match may start earlier).
        """
        if self.stop_string is not None:
            return self.stop_string
        skipped_stop_token: Optional[int] = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            if self._decoder is not None and self._append_text(self._decoder.decode_next(token_id)):
                return self.stop_string
        if skipped_stop_token is not None:
            self.output_token_ids.append(skipped_stop_token)
        if finished and self._decoder is not None and self._append_text(self._decoder.flush()):
            return self.stop_string
        return None

    def _append_text(self, new_text: str) -> bool:
        """Extend the text; True if a stop string matched (text then truncated)."""
        if not new_text:
            return False
        self.output_text += new_text
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return False
        match = _find_stop_string(self.output_text, len(new_text), self.stop)
        if match is None:
            return False
        self.stop_string, index = match
        if self.include_stop_str_in_output:
            index += len(self.stop_string)
        self.output_text = self.output_text[:index]
        return True

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to emit now.

        While the request runs, the last ``stop_buffer_length`` characters (longest stop
        string - 1) are held back, so no fragment of a stop string that matches later is
        ever emitted. ``delta=True`` returns only text not returned by an earlier delta
        call; else all text so far (minus the held-back tail).
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if last_offset >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last_offset:length]


def _find_stop_string(text: str, new_char_count: int, stop: list[str]) -> Optional[tuple[str, int]]:
    """The earliest stop string that ends within the last ``new_char_count`` characters.

    Only the tail that can hold a new match is searched: the new characters plus
    ``len(stop_str) - 1`` before them. Returns (stop string, index of its start) or None;
    on a tie the one listed first wins.
    """
    best: Optional[tuple[str, int]] = None
    for stop_str in stop:
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    return best
