"""Parametrisation grids for kernel tests: every value of each dimension, without the full
product of all of them (which would run thousands of near-identical cases at every
instruction-set level)."""

from __future__ import annotations

from typing import Any, Sequence


def latin_grid(firsts: Sequence[Any], seconds: Sequence[Any], variants: Sequence[Any]) -> list[tuple[Any, Any, Any]]:
    """Every pair (first, second) once, with variant ``(i + j) % len(variants)`` for the i-th
    first and j-th second: each variant meets every second when there are at least as many
    firsts as variants, and every first when there are at least as many seconds (a Latin
    square over the pairs). ``len(firsts) * len(seconds)`` cases instead of that times
    ``len(variants)``."""
    return [(a, b, variants[(i + j) % len(variants)]) for i, a in enumerate(firsts) for j, b in enumerate(seconds)]
