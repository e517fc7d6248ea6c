"""Speculative decoding (vLLM's ``--speculative-config``): proposers and the rejection sampler.

A proposer guesses the next k tokens of each decoding request cheaply; the target model
scores all ``1 + k`` positions in one forward pass and the rejection sampler keeps the
longest prefix it agrees with, plus one token of its own, so each step yields 1 .. k + 1
tokens. ``ngram_proposer`` (prompt lookup), ``draft_model`` (a small model with its own
paged KV cache) and ``eagle`` (an EAGLE / EAGLE-3 head reading the target's hidden states)
propose; ``rejection_sampler`` verifies (Leviathan et al. 2023, Chen et al.
2023). The model runner (``pagedllm.worker.model_runner``) drives them.
"""

from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EagleProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer

__all__ = ["DraftModelProposer", "EagleProposer", "NgramProposer"]
