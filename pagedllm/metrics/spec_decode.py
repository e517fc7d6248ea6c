"""Speculative-decoding metrics (vLLM V1's): Prometheus counters and the log line's part.

=================================================  =======  ===========================================
name (as rendered)                                  type     meaning
=================================================  =======  ===========================================
pagedllm:spec_decode_num_drafts_total               counter  verifications (one request, one step)
pagedllm:spec_decode_num_draft_tokens_total         counter  draft tokens verified
pagedllm:spec_decode_num_accepted_tokens_total      counter  of those, accepted
pagedllm:spec_decode_num_accepted_tokens_per_pos    counter  accepted drafts by draft position; label
  _total                                                     ``position`` = 0 .. k - 1
=================================================  =======  ===========================================

Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts
(tokens per verifying step, the bonus or corrected token included), as vLLM logs them.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter

from pagedllm.messages.engine_core import SpecDecodingStats


class SpecDecodingProm:
    """The four counter families, labelled ``model_name`` and ``engine`` (and ``position``)."""

    def __init__(self, registry: CollectorRegistry, prefix: str, num_spec_tokens: int) -> None:
        labels = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", labels + ["position"], registry=registry)
        self.num_spec_tokens = num_spec_tokens

    def series(self, label_values: list[str]) -> "SpecDecodingSeries":
        """One engine's counters (``label_values``: ``[model_name, engine]``)."""
        return SpecDecodingSeries(self, label_values)


class SpecDecodingSeries:
    """One engine's speculative-decoding counters; ``observe`` adds one step's statistics."""

    def __init__(self, families: SpecDecodingProm, label_values: list[str]) -> None:
        self.num_drafts = families.num_drafts.labels(*label_values)
        self.num_draft_tokens = families.num_draft_tokens.labels(*label_values)
        self.num_accepted_tokens = families.num_accepted_tokens.labels(*label_values)
        self.per_pos = [families.per_pos.labels(*label_values, str(i)) for i in range(families.num_spec_tokens)]

    def observe(self, stats: SpecDecodingStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, value in zip(self.per_pos, stats.num_accepted_tokens_per_pos):
            counter.inc(value)


class SpecDecodingLogging:
    """Sums the steps' ``SpecDecodingStats`` between two stats lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def observe(self, stats: SpecDecodingStats) -> None:
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens

    def line(self) -> Optional[str]:
        """"Spec decode acceptance rate: R%, Mean acceptance length: L" for the interval, or
        None when nothing was verified; resets the sums."""
        if not self.num_drafts:
            return None
        rate = self.num_accepted_tokens / max(self.num_draft_tokens, 1)
        length = 1 + self.num_accepted_tokens / self.num_drafts
        self.reset()
        return f"Spec decode acceptance rate: {rate * 100:.1f}%, Mean acceptance length: {length:.2f}"
