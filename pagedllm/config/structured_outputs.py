"""``StructuredOutputsConfig``: the engine's constrained-decoding options."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

#: ``StructuredOutputsConfig.backend`` values: vLLM's names of the backends built here.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding options of the engine (vLLM's ``--structured-outputs-config``).

    Attributes:
        backend: "xgrammar", "guidance" (llguidance), or "auto": xgrammar, and llguidance
            for a constraint xgrammar cannot compile or enforce.
        disable_fallback: with "auto", never fall back to llguidance.
        disable_any_whitespace: JSON output without whitespace between tokens.
        disable_additional_properties: JSON objects whose schema has no
            ``additionalProperties`` take no extra keys (llguidance; xgrammar always does so).
        max_whitespace_cnt: the most whitespace characters JSON output may have between
            two tokens (xgrammar's option of that name; llguidance: a whitespace pattern).
        max_number_digits: the most digits of the integer part of a JSON-schema integer
            or number without a ``maximum`` (or ``minimum``): the missing bound becomes
            +-(10**digits - 1), so the backends also cap its fraction and drop exponents.
        max_string_length: the ``maxLength`` of a JSON-schema string without one (nor a
            ``pattern``, ``format``, ``enum`` or ``const``); with xgrammar, of every string
            its grammar leaves unbounded (object keys of free-form objects too).
        reasoning_parser: the ``--reasoning-parser`` name of the model's reasoning format
            ("": none). With one, a constrained request's grammar starts where its reasoning
            ends (vLLM's ``reasoning_ended``): the reasoning is unconstrained and the
            content follows the grammar. ``pagedllm serve`` sets it from ``--reasoning-parser``.
        enable_in_reasoning: constrain the reasoning too (the grammar starts at the first
            output token, as without a reasoning parser).

    The last three are pagedllm's: a small model left unbounded can fill ``max_tokens``
    with newlines, digits or one endless string; None lifts a bound (vLLM's behaviour).
    Strings default to 1024 characters, long for a JSON field and short enough that a
    runaway one ends within a few hundred tokens; the bound costs xgrammar a few ms a token
    inside a string.

    Raises:
        ValueError: an unknown backend or reasoning parser, a bound below 1, or an unknown key in
            ``from_dict``.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_whitespace_cnt: Optional[int] = 2
    max_number_digits: Optional[int] = 15
    max_string_length: Optional[int] = 1024
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                f"got {self.backend!r}."
            )
        if self.reasoning_parser:
            from pagedllm.reasoning import ReasoningParserManager

            try:
                ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
            except KeyError as exc:
                raise ValueError(f"structured outputs reasoning_parser: {exc.args[0]}") from None
        for name in ("max_whitespace_cnt", "max_number_digits", "max_string_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"structured outputs {name} must be a positive integer or null, got {value!r}.")

    @classmethod
    def from_dict(cls, value: "Optional[dict | StructuredOutputsConfig]") -> "StructuredOutputsConfig":
        """The config of ``--structured-outputs-config``'s JSON object (None: defaults)."""
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value or {}) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs_config has unknown keys {unknown}; known: {', '.join(sorted(known))}."
            )
        return cls(**(value or {}))
