"""``StructuredOutputManager``: compiles constraints off the step loop and fills the batch's
token bitmask (engine-core side).

```
add_request ─▶ grammar_init: spec ─▶ compile cache hit? ──no──▶ thread pool: backend.compile
                                  │                                     │
                                  └──────────▶ thread pool: new_grammar(compiled) ─▶ request's future
schedule     ─▶ requests whose grammar is ready leave WAITING_FOR_GRAMMAR;
                grammar_bitmask: one ceil(V / 32) int32 row per position that a
                constrained request samples this step (1 + its validated drafts)
                ─▶ SchedulerOutput ─▶ sampler
update       ─▶ the scheduler advances each grammar with the accepted tokens
```

With a reasoning parser (``StructuredOutputsConfig.reasoning_parser``, vLLM's gating by
``reasoning_ended``): a grammar neither constrains nor advances until the request's
reasoning has ended (``should_fill_bitmask``, ``should_advance``): the end of the prompt
(a chat template may close the reasoning there) or of the output so far is read by the
parser's ``ends_reasoning``.

The compile cache maps a ``GrammarSpec`` (kind, text, options; the tokenizer is the
engine's own) to the compile's future, so a repeated schema costs no compilation, and
requests arriving while it compiles share it. Source: vLLM V1's
``StructuredOutputManager`` (thread pool, WAITING_FOR_GRAMMAR, one bitmask per step).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from pagedllm.config import ModelConfig, StructuredOutputsConfig
from pagedllm.reasoning import ReasoningParser, ReasoningParserManager
from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.request import StructuredOutputRequest
from pagedllm.structured_output.selection import choose_backend
from pagedllm.structured_output.spec import GrammarSpec, grammar_spec
from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Compiled grammars kept (least recently used dropped first).
COMPILE_CACHE_SIZE = 512


class StructuredOutputManager:
    """Per engine core: the backends (built on first use), the thread pool and the cache.

    Args:
        config: the engine's ``StructuredOutputsConfig``.
        model_config: the tokenizer (loaded on first use), the logits width
            (``vocab_size``, which sets the bitmask width) and the EOS ids of the
            generation config (allowed, with the tokenizer's, where a grammar may end).
    """

    def __init__(self, config: StructuredOutputsConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.bitmask_width = -(-self.vocab_size // 32)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backends_lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Future[tuple[StructuredOutputBackend, Any]]] = OrderedDict()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._reasoner: Optional[ReasoningParser] = None
        if config.reasoning_parser and not config.enable_in_reasoning:
            self._reasoner = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)()

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A request's constraint, its grammar compiling in the background (``is_ready``).

        Raises:
            ValueError: see ``grammar_spec`` (the front end has checked it already).
        """
        so_request = StructuredOutputRequest(grammar_spec(params, self.config))
        compiled = self._compile_future(so_request.spec)
        so_request.future = self._get_pool().submit(self._new_grammar, compiled)
        return so_request

    def _compile_future(self, spec: GrammarSpec) -> Future[tuple[StructuredOutputBackend, Any]]:
        future = self._compiled.get(spec)
        if future is not None:
            self._compiled.move_to_end(spec)
            return future
        future = self._get_pool().submit(self._compile, spec)
        self._compiled[spec] = future
        if len(self._compiled) > COMPILE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            workers = max(1, min(8, (os.cpu_count() or 2) // 2))
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        return self._pool

    def _compile(self, spec: GrammarSpec) -> tuple[StructuredOutputBackend, Any]:
        """(backend, compiled grammar) of ``spec``; runs in the pool."""
        name = choose_backend(spec, self.config.backend, self.config.disable_fallback)
        backend = self._backend(name)
        return backend, backend.compile(spec)

    @staticmethod
    def _new_grammar(compiled: Future[tuple[StructuredOutputBackend, Any]]) -> StructuredOutputGrammar:
        # NOTE: the compile was submitted before this (FIFO pool), so waiting here cannot
        # starve it.
        backend, grammar = compiled.result()
        return backend.new_grammar(grammar)

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._backends_lock:
            if name not in self._backends:
                self._backends[name] = self._build_backend(name)
            return self._backends[name]

    def _get_tokenizer(self) -> Any:
        """The engine's tokenizer, loaded once (by the first backend or reasoning check)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from pagedllm.tokenizer import get_tokenizer

                self._tokenizer = get_tokenizer(self.model_config.tokenizer_path, self.model_config.trust_remote_code)
            return self._tokenizer

    def _build_backend(self, name: str) -> StructuredOutputBackend:
        tokenizer = self._get_tokenizer()
        stop_ids = sorted(({tokenizer.eos_token_id} | self.model_config.generation_config_eos_ids()) - {None})
        if name == "xgrammar":
            from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

            return XgrammarBackend(tokenizer, self.vocab_size, stop_ids)
        from pagedllm.structured_output.backend_guidance import GuidanceBackend

        return GuidanceBackend(tokenizer, self.vocab_size, stop_ids)

    def should_fill_bitmask(self, so_request: StructuredOutputRequest, prompt_token_ids: list[int]) -> bool:
        """Whether the request's grammar constrains its next token: always without a
        reasoning parser; else once its reasoning has ended (by the end of its prompt, seen
        on the first call, or by ``should_advance``)."""
        if self._reasoner is None:
            return True
        if so_request.reasoning_ended is None:
            so_request.reasoning_ended = self._reasoner.ends_reasoning(prompt_token_ids, self._get_tokenizer())
        return so_request.reasoning_ended

    def should_advance(
        self, so_request: StructuredOutputRequest, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> bool:
        """Whether the grammar takes the newest of ``output_token_ids`` (the request's output
        so far): yes once the reasoning had ended before it. The token that ends the
        reasoning belongs to the reasoning (the grammar does not take it) and the grammar
        constrains from the next one on (vLLM's ``should_advance``)."""
        if self.should_fill_bitmask(so_request, prompt_token_ids):
            return True
        assert self._reasoner is not None
        if self._reasoner.ends_reasoning(output_token_ids, self._get_tokenizer()):
            so_request.reasoning_ended = True
        return False

    def grammar_bitmask(self, grammars: list[StructuredOutputGrammar],
                        draft_token_ids: Optional[list[list[int]]] = None) -> np.ndarray:
        """The next-token bitmasks of each grammar, in order: one row per position its
        request samples this step, i.e. from its state, then after each of its draft tokens
        in turn (speculative decoding, as vLLM's manager); every grammar is rolled back to
        its state afterwards.

        Args:
            grammars: the constrained requests' matchers.
            draft_token_ids: per grammar, the draft tokens verified this step (validated:
                ``StructuredOutputGrammar.validate_tokens``); None: no drafts.

        Returns:
            [len(grammars) + number of drafts, ceil(vocab_size / 32)] int32 (xgrammar's
            layout: bit ``t % 32`` of word ``t // 32`` set means token t is allowed). A
            row after a draft that ended the grammar allows every token (the request stops
            at that draft, whatever follows).
        """
        drafts = draft_token_ids or [[] for _ in grammars]
        bitmask = np.full((len(grammars) + sum(map(len, drafts)), self.bitmask_width), -1, dtype=np.int32)
        row = 0
        for grammar, tokens in zip(grammars, drafts):
            grammar.fill_bitmask(bitmask, row)
            advanced = 0
            for token in tokens:
                # NOTE: past a draft the grammar refuses (or ends at), rows allow everything:
                # the target rejects that draft (or the request stops at it) anyway.
                if grammar.is_terminated() or not grammar.accept_tokens([token]):
                    break
                advanced += 1
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row + advanced)
            if advanced:
                grammar.rollback(advanced)
            row += 1 + len(tokens)
        return bitmask

    def shutdown(self) -> None:
        """Stop the pool (compiles in progress finish; queued ones are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
