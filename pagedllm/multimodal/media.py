"""Images and videos from the URLs of chat requests' ``image_url`` / ``video_url`` parts
(vLLM's ``MediaConnector``): ``data:image/...;base64,`` (``data:video/...``) URLs, ``file://``
paths under ``--allowed-local-media-path`` only, and ``http(s)://`` URLs (hosts of
``--allowed-media-domains`` only, when given) fetched with a timeout
(``PAGEDLLM_IMAGE_FETCH_TIMEOUT`` / ``PAGEDLLM_VIDEO_FETCH_TIMEOUT``), a size cap
(``PAGEDLLM_MAX_IMAGE_BYTES`` / ``PAGEDLLM_MAX_VIDEO_BYTES``) and at most ``MAX_REDIRECTS``
redirects, each checked as the first URL (videos are decoded by ``pagedllm.multimodal.video``).
Every failure is a ``MediaError`` (a ``ValueError``) saying why, for the caller to name the part."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedllm import envs

#: Redirects an http(s) image URL may take.
MAX_REDIRECTS = 3


class MediaError(ValueError):
    """A media URL that cannot be served: refused, unreachable, too large or not an image / video."""


def decode_image(data: bytes) -> Any:
    """The RGB PIL image of an encoded image's bytes, fully decoded (a truncated file fails here).

    Raises:
        MediaError: not a readable image.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except Image.UnidentifiedImageError:  # its message names the BytesIO object: say what it means
        raise MediaError("the image could not be decoded (not a format Pillow reads: PNG, JPEG, WebP, GIF, ...)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from None


class MediaConnector:
    """Loads images and videos from URLs under the server's media settings.

    Args:
        allowed_local_media_path: the folder ``file://`` URLs may name files under (None: refused).
        allowed_media_domains: the hosts ``http(s)://`` URLs may point at (None: any).
        timeout_s, max_bytes: an image fetch's limits (None: the environment's).
        video_timeout_s, max_video_bytes: a video fetch's limits (None: the environment's).
    """

    def __init__(self, allowed_local_media_path: Optional[Path] = None,
                 allowed_media_domains: Optional[Sequence[str]] = None, timeout_s: Optional[float] = None,
                 max_bytes: Optional[int] = None, video_timeout_s: Optional[float] = None,
                 max_video_bytes: Optional[int] = None) -> None:
        self.allowed_local_media_path = allowed_local_media_path
        self.allowed_media_domains = tuple(allowed_media_domains) if allowed_media_domains else None
        self.limits = {
            "image": (timeout_s if timeout_s is not None else envs.PAGEDLLM_IMAGE_FETCH_TIMEOUT.get(),
                      max_bytes if max_bytes is not None else envs.PAGEDLLM_MAX_IMAGE_BYTES.get()),
            "video": (video_timeout_s if video_timeout_s is not None else envs.PAGEDLLM_VIDEO_FETCH_TIMEOUT.get(),
                      max_video_bytes if max_video_bytes is not None else envs.PAGEDLLM_MAX_VIDEO_BYTES.get()),
        }
        self.timeout_s, self.max_bytes = self.limits["image"]

    def load_image(self, url: str) -> Any:
        """The RGB PIL image at ``url``.

        Raises:
            MediaError: a scheme other than data / file / http(s); see ``fetch_bytes``.
        """
        return decode_image(self.fetch_bytes(url))

    def fetch_bytes(self, url: str, kind: str = "image") -> bytes:
        """The encoded image (``kind`` "image") or video ("video") at ``url``.

        Raises:
            MediaError: a ``data:`` URL that is not base64 ``<kind>/*``; a ``file://`` URL with no
                ``--allowed-local-media-path`` or outside it, or unreadable; an http(s) URL to a
                host not allowed, that fails, times out, redirects too often, is not ``<kind>/*``
                or is larger than the kind's size cap.
        """
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, kind)
        if scheme == "file":
            return self._local_file(url, kind)
        if scheme in ("http", "https"):
            return self._fetch(url, kind)
        raise MediaError(f"unsupported {kind} URL scheme {scheme or url[:16]!r} (data:, file:// or http(s)://)")

    def _data_url(self, url: str, kind: str) -> bytes:
        header, sep, payload = url[len("data:"):].partition(",")
        mime = header.split(";", 1)[0].strip().lower()
        if not sep or ";base64" not in header.lower():
            raise MediaError(f"a data: {kind} URL must be base64 (data:{kind}/...;base64,...)")
        if not mime.startswith(f"{kind}/"):
            raise MediaError(f"the data: URL's MIME type is {mime or 'missing'!r}, not {'an' if kind == 'image' else 'a'} {kind}/* type")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL's base64 payload is invalid") from None
        self._check_size(len(data), kind)
        return data

    def _local_file(self, url: str, kind: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise MediaError(f"file:// {kind} URLs are refused: the server has no --allowed-local-media-path")
        parsed = urllib.parse.urlparse(url)
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.allowed_local_media_path):
            raise MediaError(f"{path} is outside --allowed-local-media-path ({self.allowed_local_media_path})")
        try:
            size = path.stat().st_size
            self._check_size(size, kind)
            return path.read_bytes()
        except OSError as exc:
            raise MediaError(f"{path} cannot be read ({exc.strerror or exc})") from None

    def _check_host(self, url: str, kind: str) -> None:
        host = urllib.parse.urlparse(url).hostname or ""
        if self.allowed_media_domains is not None and host not in self.allowed_media_domains:
            raise MediaError(f"the {kind} URL's host {host!r} is not in --allowed-media-domains")

    def _check_size(self, size: int, kind: str) -> None:
        max_bytes = self.limits[kind][1]
        if size > max_bytes:
            raise MediaError(f"the {kind} is larger than {max_bytes} bytes (PAGEDLLM_MAX_{kind.upper()}_BYTES)")

    def _fetch(self, url: str, kind: str) -> bytes:
        import httpx

        timeout_s = self.limits[kind][0]
        with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_host(url, kind)
                try:
                    with client.stream("GET", url) as response:
                        if response.is_redirect and "location" in response.headers:
                            url = urllib.parse.urljoin(url, response.headers["location"])
                            continue
                        return self._body(url, response, kind)
                except httpx.TimeoutException:
                    raise MediaError(f"fetching {url} timed out after {timeout_s} s") from None
                except httpx.HTTPError as exc:
                    raise MediaError(f"fetching {url} failed ({type(exc).__name__}: {exc})") from None
        raise MediaError(f"the {kind} URL redirected more than {MAX_REDIRECTS} times")

    def _body(self, url: str, response: Any, kind: str) -> bytes:
        if response.status_code != 200:
            raise MediaError(f"fetching {url} failed: HTTP {response.status_code}")
        mime = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if mime and not mime.startswith(f"{kind}/"):
            raise MediaError(f"{url} is {mime!r}, not {'an' if kind == 'image' else 'a'} {kind}/* type")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit():
            self._check_size(int(declared), kind)
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            self._check_size(size, kind)
            chunks.append(chunk)
        return b"".join(chunks)
