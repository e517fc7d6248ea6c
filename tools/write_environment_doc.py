#!/usr/bin/env python3
"""Write docs/environment.md from the declarations in ``pagedllm/envs.py`` (tests/test_envs.py
fails when the file and the declarations disagree). Run after changing a declaration::

    .venv/bin/python tools/write_environment_doc.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedllm import envs  # noqa: E402

DOC = ROOT / "docs" / "environment.md"

if __name__ == "__main__":
    DOC.write_text(envs.markdown_page())
    print(f"wrote {DOC.relative_to(ROOT)} ({len(envs.VARIABLES)} variables)")
