"""The chat page of ``pagedllm serve``: ``GET /`` (``static/index.html``) and its scripts and
style under ``/static/``, plain files shipped in the package (no build step, nothing fetched
from elsewhere). ``--disable-frontend`` leaves these routes out (``/`` is then 404).

The page itself is public (it must load to ask for the API key); everything it does goes
through the ``/v1`` routes, which keep their auth. See ``static/chat.js`` for what it does.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

#: Where the page's files live (package data: ``pyproject.toml`` ships them).
STATIC_DIR = Path(__file__).with_name("static")
#: The files served under ``/static/``, with their media types.
STATIC_FILES = {
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
#: Scripts, styles and requests only from the server itself (no inline script, no CDN).
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


def is_page_path(path: str) -> bool:
    """Whether ``path`` (below the app's root path) is one of the page's routes."""
    return path in ("", "/") or path.removeprefix("/static/") in STATIC_FILES


def add_chat_page_routes(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files at ``/static/<name>`` on ``app``."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def chat_page_file(name: str) -> Response:
        if name not in STATIC_FILES:
            return Response(status_code=404)
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name], headers=_HEADERS)
