"""The two interfaces a structured-output backend implements (plain Python; no torch).

A *backend* compiles a constraint (``GrammarSpec``) into a reusable compiled grammar for one
tokenizer, and makes a *grammar* (a matcher with state) from it for each request. The
engine core advances a request's grammar with every accepted token and asks it, each step,
for the bitmask of the tokens it allows next. Source of the design: vLLM V1's
``StructuredOutputBackend`` / ``StructuredOutputGrammar``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from pagedllm.structured_output.spec import GrammarSpec


class StructuredOutputGrammar(ABC):
    """One request's matcher: its state is the output tokens accepted so far.

    The token-level API accepts several tokens at once and can undo them, so a
    speculative-decoding step can check draft tokens (``validate_tokens``), accept the
    verified ones and roll back the rest.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids`` in order; False (and no change past the first
        rejected token) if the grammar does not allow one of them."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar allows from its state, which is
        left unchanged."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([N, ceil(V / 32)] int32;
        bit ``t % 32`` of word ``t // 32`` set means token t is allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has ended (it accepted a stop token, or allows nothing more)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state (no tokens accepted)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary.

    Args (of implementations): the HF tokenizer, ``vocab_size`` (the model's logits width,
    which may exceed the tokenizer's size: the extra ids are never allowed) and the token
    ids that end generation (allowed where the grammar may end).
    """

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (thread-safe; may take milliseconds to seconds).

        Raises:
            ValueError: the constraint does not compile (the backend's message).
        """

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a result of ``compile``."""
