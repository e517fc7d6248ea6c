"""Tokenizer loading (HF transformers' fast tokenizers)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved at ``path`` (tokenizer.json / tokenizer_config.json).

    Raises:
        ValueError: if no tokenizer can be loaded from ``path``.
    """
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot load a tokenizer from {path}: {exc}") from exc
