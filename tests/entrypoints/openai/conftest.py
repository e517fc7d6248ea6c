"""What the OpenAI server tests share: the shared server's settings (its fixtures ``server``,
``client`` and ``default_model_server`` are in ``tests/conftest.py``) and an SSE parser.

The ``server`` fixture's API keys are ``API_KEY`` and ``OTHER_API_KEY``, its served names
``MODEL_NAME`` and ``MODEL_ALIAS``, its ``max_model_len`` ``MAX_MODEL_LEN`` (given as ``2K``).
Tests that kill the engine start their own.
"""

from __future__ import annotations

from tests.server_utils import API_KEY, MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME, OTHER_API_KEY

__all__ = ["API_KEY", "MAX_MODEL_LEN", "MODEL_ALIAS", "MODEL_NAME", "OTHER_API_KEY", "parse_sse"]


def parse_sse(body: str) -> list:
    """The JSON events of an SSE body, ``"[DONE]"`` kept as that string."""
    import json

    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
