"""How many draft tokens each request asks for, step by step (``enable_adaptive_k``).

A fixed speculation length k costs k proposals and k extra verified rows every step, however
few drafts are accepted: a draft that is never accepted makes decoding slower. Here each
request's length is chosen anew each step (no torch; the scheduler calls it):

* acceptance: per request, an exponential moving average of its accepted drafts and of its
  draft "trials" (each verified draft position reached: the accepted ones, plus the first
  rejected one), weighted ``ema_alpha`` for the newest step (vLLM's
  ``adaptive_k_ema_alpha``); their ratio is alpha, the chance that a draft is accepted once
  the ones before it were. A new request starts from the same average over all requests'
  verifications (``_PRIOR_ACCEPTANCE`` before any), worth ``_PRIOR_TRIALS`` draft positions;
* cost: one draft token's cost relative to a plain step's share per request, measured from
  the engine's steps: a least-squares line of (step seconds / requests) against (draft
  tokens proposed and verified in the step / requests), decaying with ``_COST_DECAY`` per
  step, never below ``_MIN_COST``; until the steps vary enough to draw it, ``prior_cost``.
  Once drawn, a step is counted at no more than ``_OUTLIER_FACTOR`` times the line's time
  for it: one step stalled by the machine (another process, two OpenMP threads on a busy
  host: 10-50x its time) would otherwise tilt the line for ~50 steps, and a steep line
  stops all drafting (seen with n-gram lookup: cost 0.02 -> 5.7 of a step, k = 0 for a
  whole request);
* choice: the k in 0 .. ``num_speculative_tokens`` that maximises the expected tokens per
  unit of cost, E(k) / (1 + k c), with E(k) = 1 + alpha + ... + alpha^k (Leviathan et al.
  2023's expected tokens per step for i.i.d. acceptance; the same goodput rule as DISCO,
  Mamou et al. 2024, and vLLM's proposed Adaptive K);
* probes: a request at k = 0 is given k = 1 once after ``_PROBE_FIRST`` steps, then after
  twice as many each time it stays at 0 (up to ``_PROBE_MAX``), so its acceptance is
  re-estimated at a bounded cost.

The choice changes only how many drafts are proposed, never how they are verified: greedy
output stays token-identical and sampled output keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Acceptance assumed before any verification; a new request's prior is worth
#: ``_PRIOR_TRIALS`` observed draft positions.
_PRIOR_ACCEPTANCE = 0.6
_PRIOR_TRIALS = 2.0
#: Steps at k = 0 before the first probe; the interval doubles up to the second.
_PROBE_FIRST = 8
_PROBE_MAX = 64
#: Weight kept by the cost fit's old steps at each new step (about 50 steps' memory).
_COST_DECAY = 0.98
#: The least cost a draft token is taken to have (a verified row is never free; a fit on
#: noisy timings can give 0, which would make any acceptance worth the longest draft).
_MIN_COST = 0.02
#: The fit's draft-token counts must spread this much (a standard deviation, in draft
#: tokens per request) before its slope replaces the prior.
_MIN_SPREAD = 0.5
#: A step enters the fit at no more than this many times the fitted time for its draft
#: tokens (a lasting slow-down still moves the line: by up to this factor per step).
_OUTLIER_FACTOR = 2.0


@dataclass
class _Acceptance:
    accepted: float = _PRIOR_ACCEPTANCE * _PRIOR_TRIALS
    trials: float = _PRIOR_TRIALS
    idle_steps: int = 0
    probe_interval: int = _PROBE_FIRST


def best_length(alpha: float, cost: float, max_tokens: int) -> int:
    """The k in 0 .. ``max_tokens`` with the most expected tokens per unit of step cost,
    E(k) / (1 + k ``cost``) (``cost``: one draft token relative to a plain step; E(k) =
    1 + alpha + ... + alpha^k, the tokens a step yields with k drafts each accepted with
    probability ``alpha`` once the previous ones were); ties go to the shorter. Runs once per
    request and step: E(k) is built up term by term."""
    best, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_tokens + 1):
        term *= alpha
        expected += term
        rate = expected / (1.0 + k * cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class SpeculationLength:
    """Per-request speculation lengths from measured acceptance and measured step costs.

    Args:
        max_tokens: the most drafts per request and step (``num_speculative_tokens``).
        ema_alpha: the newest step's weight in the acceptance averages (0 < a <= 1).
        prior_cost: one draft token's cost relative to a plain step's share per request,
            assumed until measured.
    """

    def __init__(self, max_tokens: int, ema_alpha: float, prior_cost: float) -> None:
        self.max_tokens = max_tokens
        self.ema_alpha = ema_alpha
        self.prior_cost = prior_cost
        self._requests: dict[str, _Acceptance] = {}
        # Every request's verifications together: new requests' prior.
        self._pooled = _Acceptance()
        # Decayed sums of the cost fit: weight, x, y, x*x, x*y (x: draft tokens per request,
        # y: seconds per request).
        self._sums = [0.0] * 5

    def acceptance(self, req_id: str) -> float:
        """The request's estimated acceptance rate alpha (the prior for a new one)."""
        state = self._requests.get(req_id, self._pooled)
        return state.accepted / state.trials

    @property
    def draft_token_cost(self) -> float:
        """One draft token's cost relative to a plain step's share per request: the fit's
        slope (two per draft token: proposing and verifying) over its intercept, else the
        prior; at least ``_MIN_COST``."""
        line = self._line()
        if line is None:
            return self.prior_cost
        slope, intercept = line
        return max(2.0 * slope / intercept, _MIN_COST)

    def _line(self) -> tuple[float, float] | None:
        """The fit's (slope >= 0, intercept > 0): seconds per request = intercept + slope x
        draft tokens per request; None until the draft-token counts spread enough."""
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if w <= 0 or spread < (_MIN_SPREAD * w) ** 2:
            return None
        slope = max((w * xy - x * y) / spread, 0.0)
        intercept = (y - slope * x) / w
        return (slope, intercept) if intercept > 0 else None

    def num_tokens(self, req_id: str) -> int:
        """How many drafts to propose for ``req_id`` after its coming step (call once per
        step in which it samples)."""
        state = self._state(req_id)
        k = best_length(state.accepted / state.trials, self.draft_token_cost, self.max_tokens)
        if k > 0:
            state.idle_steps, state.probe_interval = 0, _PROBE_FIRST
            return k
        state.idle_steps += 1
        if state.idle_steps < state.probe_interval:
            return 0
        state.idle_steps, state.probe_interval = 0, min(2 * state.probe_interval, _PROBE_MAX)
        return 1

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record one verification of ``req_id``: ``num_accepted`` of ``num_drafts`` drafts."""
        keep = 1.0 - self.ema_alpha
        trials = num_accepted + (num_accepted < num_drafts)
        for state in (self._state(req_id), self._pooled):
            state.accepted = keep * state.accepted + self.ema_alpha * num_accepted
            state.trials = keep * state.trials + self.ema_alpha * trials

    def _state(self, req_id: str) -> _Acceptance:
        state = self._requests.get(req_id)
        if state is None:
            prior = self._pooled.accepted / self._pooled.trials
            state = self._requests[req_id] = _Acceptance(prior * _PRIOR_TRIALS, _PRIOR_TRIALS)
        return state

    def observe_step(self, seconds: float, num_requests: int, num_draft_tokens: int) -> None:
        """Record a decode step (no prompt tokens) of ``num_requests`` requests that took
        ``seconds`` and proposed and verified ``num_draft_tokens`` draft tokens in all."""
        if num_requests <= 0 or seconds <= 0:
            return
        x, y = num_draft_tokens / num_requests, seconds / num_requests
        line = self._line()
        if line is not None:
            y = min(y, _OUTLIER_FACTOR * (line[1] + line[0] * x))
        sums = self._sums
        for i, value in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] = _COST_DECAY * sums[i] + value

    def remove(self, req_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(req_id, None)
