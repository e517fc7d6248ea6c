"""``StructuredOutputRequest``: a request's constraint and, once compiled, its grammar."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

from pagedllm.structured_output.backend_types import StructuredOutputGrammar
from pagedllm.structured_output.spec import GrammarSpec


class StructuredOutputRequest:
    """What the scheduler keeps for a constrained request.

    ``future`` (set by ``StructuredOutputManager.grammar_init``) resolves to the request's
    own grammar (one matcher per sequence: each of ``n`` completions is its own request);
    ``grammar`` is None until ``is_ready`` has seen it resolve. ``reasoning_ended`` (vLLM's
    field): with a reasoning parser, whether the request's reasoning has ended, so that its
    grammar applies (None: not looked at yet); kept by ``StructuredOutputManager``.
    """

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.future: Optional[Future[StructuredOutputGrammar]] = None
        self.grammar: Optional[StructuredOutputGrammar] = None
        self.reasoning_ended: Optional[bool] = None

    def is_ready(self) -> bool:
        """True once the grammar is compiled (non-blocking).

        Raises:
            ValueError: the compilation failed (the backend's message).
        """
        if self.grammar is None:
            assert self.future is not None, "grammar_init was not called"
            if not self.future.done():
                return False
            self.grammar = self.future.result()
        return True
