"""Which backend compiles a constraint, decided without a tokenizer (fast, cached).

The front end calls ``check_structured_outputs`` on every request before anything runs,
so a schema, regex or grammar that no allowed backend takes is a ``ValueError`` (a 400
from the server) with the backend's message; the engine core calls ``choose_backend``
again (cached) before it compiles. ``auto`` is xgrammar, falling back to llguidance for
what xgrammar cannot parse or enforce, as vLLM's ``auto``.
"""

from __future__ import annotations

import functools

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.spec import GrammarSpec, grammar_spec


def check_structured_outputs(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> str:
    """Validate a request's constraint; returns the backend that will compile it.

    Raises:
        ValueError: "Invalid structured outputs <kind>: <the backend's message>".
    """
    return choose_backend(grammar_spec(params, config), config.backend, config.disable_fallback)


@functools.lru_cache(maxsize=1024)
def choose_backend(spec: GrammarSpec, backend: str, disable_fallback: bool) -> str:
    """"xgrammar" or "guidance": the backend for ``spec`` under the engine's ``backend``
    ("auto", "xgrammar" or "guidance") and ``disable_fallback``.

    Raises:
        ValueError: see ``check_structured_outputs``.
    """
    from pagedllm.structured_output import backend_guidance, backend_xgrammar

    if backend == "guidance":
        return _checked(spec, "guidance", backend_guidance.validate)
    try:
        backend_xgrammar.build_grammar(spec)
        return "xgrammar"
    except ValueError as exc:
        if backend == "xgrammar" or disable_fallback:
            raise ValueError(f"Invalid structured outputs {spec.kind}: {exc}") from None
        xgrammar_error = exc
    try:
        backend_guidance.validate(spec)
    except ValueError as exc:
        raise ValueError(
            f"Invalid structured outputs {spec.kind}: {xgrammar_error} (llguidance: {exc})"
        ) from None
    return "guidance"


def _checked(spec: GrammarSpec, name: str, validate) -> str:
    try:
        validate(spec)
    except ValueError as exc:
        raise ValueError(f"Invalid structured outputs {spec.kind}: {exc}") from None
    return name
