#!/usr/bin/env python3
"""Write docs/models.md from the table in ``pagedllm/model_executor/models/registry.py``
(tests/model_executor/test_registry.py fails when the file and the table disagree). Run after
registering an architecture::

    .venv/bin/python tools/write_models_doc.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedllm.model_executor.models import registry  # noqa: E402

DOC = ROOT / "docs" / "models.md"

if __name__ == "__main__":
    DOC.write_text(registry.markdown_page())
    print(f"wrote {DOC.relative_to(ROOT)} ({len(registry.SUPPORTED_MODELS)} architectures)")
