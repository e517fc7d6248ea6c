"""Tokenizer loading (HF transformers' fast tokenizers) and GPT-2's byte map."""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


#: transformers' key for its "Token indices sequence length is longer than the specified
#: maximum sequence length" warning, marked as already given on every tokenizer loaded here.
_TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def get_tokenizer(path: Path | str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved at ``path`` (tokenizer.json / tokenizer_config.json, or a
    ``.gguf`` file's ``tokenizer.ggml.*`` metadata);
    ``trust_remote_code`` lets transformers run a tokenizer class shipped with the checkpoint
    (``--trust-remote-code``, as vLLM).

    transformers' warning about prompts longer than the tokenizer's ``model_max_length`` is
    silenced: the engine checks lengths against ``max_model_len`` itself and answers a
    prompt that does not fit with its own error.

    Raises:
        ValueError: if no tokenizer can be loaded from ``path``.
    """
    path = Path(path)
    try:
        if path.suffix == ".gguf":  # transformers builds the tokenizer from the file's metadata
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        hint = " (pass --tokenizer / LLM(tokenizer=...) with a Hugging Face tokenizer folder)" if path.suffix == ".gguf" else ""
        raise ValueError(f"Cannot load a tokenizer from {path}{hint}: {exc}") from exc
    tokenizer.deprecation_warnings[_TOO_LONG_WARNING] = True
    return tokenizer


@functools.lru_cache(maxsize=1)
def byte_level_char_to_byte() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte
    in a token's string -> that byte (256 entries; shared by every byte-level tokenizer:
    GPT-2, Llama 3, Qwen ...)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # byte -> character

    return {char: byte for byte, char in bytes_to_unicode().items()}
