"""``ObservabilityConfig``: request tracing over OpenTelemetry (vLLM's ``ObservabilityConfig``
fields ``otlp_traces_endpoint`` and ``collect_detailed_traces``). Standard library only."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

#: The values ``--collect-detailed-traces`` takes (vLLM's ``DetailedTraceModules``).
DETAILED_TRACE_MODULES = ("all", "model", "worker")


def detailed_traces_type(value: str) -> list[str]:
    """``--collect-detailed-traces``: a comma-separated list of ``DETAILED_TRACE_MODULES``
    (``"model,worker"``), as vLLM's flag.

    Raises:
        argparse.ArgumentTypeError: an empty list or an unknown name.
    """
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in DETAILED_TRACE_MODULES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected a comma-separated list of {', '.join(DETAILED_TRACE_MODULES)}"
        )
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class ObservabilityConfig:
    """Where request spans go and how much they say.

    ``otlp_traces_endpoint``: the OTLP/gRPC collector that receives one span per request
    (``pagedllm.tracing``), e.g. ``http://127.0.0.1:4317`` (plain text), ``https://...``
    (TLS), or ``grpc://host:port`` / ``host:port`` (TLS unless ``OTEL_EXPORTER_OTLP_INSECURE``
    is true: the OpenTelemetry SDK's own rule). None: no tracing.
    ``collect_detailed_traces``: names from ``DETAILED_TRACE_MODULES``; any of them adds the
    request's engine timeline (queued, scheduled, first token, last token) to its span as
    span events. It needs an endpoint, as vLLM's.

    Raises:
        ValueError: an empty endpoint, an endpoint with a scheme other than http, https or
            grpc, an unknown module name, or detailed traces without an endpoint (vLLM's message).
    """

    otlp_traces_endpoint: Optional[str] = None
    collect_detailed_traces: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None:
            scheme, separator, rest = endpoint.partition("://")
            if not endpoint.strip() or (separator and (scheme not in ("http", "https", "grpc") or not rest)):
                raise ValueError(
                    f"otlp_traces_endpoint must be host:port or an http://, https:// or grpc:// URL, got {endpoint!r}."
                )
        modules = self.collect_detailed_traces
        if modules is not None:
            unknown = [name for name in modules if name not in DETAILED_TRACE_MODULES]
            if unknown:
                raise ValueError(
                    f"collect_detailed_traces takes {', '.join(DETAILED_TRACE_MODULES)}; got {', '.join(unknown)}."
                )
            object.__setattr__(self, "collect_detailed_traces", tuple(modules))  # frozen: set once, here
        if self.collect_detailed_traces and endpoint is None:
            raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")

    @property
    def tracing_enabled(self) -> bool:
        """Whether requests are traced (an endpoint is set)."""
        return self.otlp_traces_endpoint is not None

    @property
    def detailed(self) -> bool:
        """Whether spans carry the engine timeline as events (``collect_detailed_traces``)."""
        return bool(self.collect_detailed_traces)
