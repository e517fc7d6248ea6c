"""A local stand-in for the Hugging Face Hub: serves checkpoint directories under the Hub's
URL layout, so ``huggingface_hub.snapshot_download`` (pointed at it with ``HF_ENDPOINT``)
downloads from it as it would from huggingface.co.

Routes (those ``snapshot_download`` uses):

- ``GET /api/models/{org}/{name}/revision/{revision}``: the repo's commit ``sha`` and files;
- ``GET /api/models/{org}/{name}/tree/{revision}``: the file listing (``recursive``);
- ``HEAD`` / ``GET /{org}/{name}/resolve/{revision}/{path}``: a file, with ``X-Repo-Commit``
  and ``ETag`` headers.

Unknown repos and revisions answer 404 with the Hub's ``X-Error-Code`` header. With a
``token`` set, requests without ``Authorization: Bearer <token>`` answer 401. Every
request path is recorded in ``requests``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse


class StandInHub:
    """``repos`` maps ``"org/name"`` to ``{revision: directory}``; the first revision is
    also served as ``main``. Use as a context manager; ``endpoint`` is the base URL."""

    def __init__(self, repos: dict[str, dict[str, Path]], token: Optional[str] = None) -> None:
        self.repos = repos
        self.token = token
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "StandInHub":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _lookup(self, repo: str, revision: str) -> Optional[tuple[str, Path]]:
        revisions = self.repos.get(repo)
        if not revisions:
            return None
        if revision == "main":
            revision = next(iter(revisions))
        for name, directory in revisions.items():
            sha = hashlib.sha1(f"{repo}@{name}".encode()).hexdigest()
            if revision in (name, sha):
                return sha, directory
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _not_found(self, code: str, head: bool) -> None:
                self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, head)

            def _serve(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append(path)
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self._send(401, b'{"error": "Invalid credentials"}', {"X-Error-Code": "InvalidCredentials"}, head)
                    return
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo, kind, revision = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
                    found = hub._lookup(repo, revision)
                    if found is None:
                        code = "RepoNotFound" if repo not in hub.repos else "RevisionNotFound"
                        return self._not_found(code, head)
                    sha, directory = found
                    files = sorted(p for p in directory.rglob("*") if p.is_file())
                    names = [str(p.relative_to(directory)) for p in files]
                    if kind == "revision":
                        body = {"id": repo, "sha": sha, "siblings": [{"rfilename": n} for n in names]}
                    else:
                        body = [
                            {"type": "file", "path": n, "size": p.stat().st_size,
                             "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                            for n, p in zip(names, files)
                        ]  # fmt: skip
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, revision, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                    found = hub._lookup(repo, revision)
                    if found is None or not (found[1] / name).is_file():
                        return self._not_found("EntryNotFound" if found else "RepoNotFound", head)
                    sha, directory = found
                    data = (directory / name).read_bytes()
                    etag = f'"{hashlib.sha1(data).hexdigest()}"'
                    return self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag}, head)
                self._not_found("RepoNotFound", head)

            def do_GET(self) -> None:
                self._serve(head=False)

            def do_HEAD(self) -> None:
                self._serve(head=True)

        return Handler
