"""``MultiModalConfig``: how an image-text model takes images (vLLM's ``MultiModalConfig`` and
its media options): how many per prompt, the processor's options, where chat ``image_url`` /
``video_url`` parts may be read from and how videos are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

#: Modalities a prompt may carry (``--limit-mm-per-prompt`` keys).
MODALITIES = ("image", "video")
#: ``--media-io-kwargs`` options per modality, with their checks.
MEDIA_IO_OPTIONS = {"video": {"num_frames": "an integer >= 1, or -1 for every frame"}}


@dataclass(frozen=True)
class MultiModalConfig:
    """Attributes:
        limit_per_prompt: modality -> the most items one prompt may carry (vLLM's
            ``--limit-mm-per-prompt``; a modality not named: no limit).
        mm_processor_kwargs: options of every call of the model's transformers processor.
        trust_request_mm_kwargs: whether a request may bring its own ``mm_processor_kwargs``.
        allowed_local_media_path: the folder ``file://`` image URLs may be read under (None:
            ``file://`` URLs are refused).
        allowed_media_domains: the host names ``http(s)://`` image URLs may point at (None: any).
        media_io_kwargs: modality -> options of loading media from URLs (vLLM's
            ``--media-io-kwargs``): ``{"video": {"num_frames": N}}``, the frames a video is
            sampled to uniformly (default ``pagedllm.multimodal.video.DEFAULT_NUM_FRAMES``).
    """

    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    trust_request_mm_kwargs: bool = False
    allowed_local_media_path: Optional[Path] = None
    allowed_media_domains: Optional[tuple[str, ...]] = None
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def video_num_frames(self) -> Optional[int]:
        """``--media-io-kwargs``' ``video.num_frames`` (None: not set)."""
        return self.media_io_kwargs.get("video", {}).get("num_frames")

    @classmethod
    def from_engine_args(cls, limit_mm_per_prompt: Optional[dict], mm_processor_kwargs: Optional[dict],
                         trust_request_mm_kwargs: bool, allowed_local_media_path: Optional[str],
                         allowed_media_domains: Optional[list[str]], media_io_kwargs: Optional[dict] = None
                         ) -> "MultiModalConfig":
        """The config of the engine arguments of the same names.

        Raises:
            ValueError: an unknown modality or a limit that is not a non-negative integer; an
                ``allowed_local_media_path`` that is not an existing folder; a
                ``media_io_kwargs`` modality or option not in ``MEDIA_IO_OPTIONS``, or a bad value.
        """
        limits = dict(limit_mm_per_prompt or {})
        for modality, limit in limits.items():
            if modality not in MODALITIES:
                raise ValueError(f"--limit-mm-per-prompt: unknown modality {modality!r} (known: {', '.join(MODALITIES)}).")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"--limit-mm-per-prompt: the {modality} limit must be a non-negative integer, got {limit!r}.")
        local = None
        if allowed_local_media_path:
            local = Path(allowed_local_media_path).resolve()
            if not local.is_dir():
                raise ValueError(f"--allowed-local-media-path {allowed_local_media_path!r} is not an existing folder.")
        domains = tuple(allowed_media_domains) if allowed_media_domains else None
        return cls(limits, dict(mm_processor_kwargs) if mm_processor_kwargs else None, bool(trust_request_mm_kwargs),
                   local, domains, _checked_media_io_kwargs(media_io_kwargs or {}))


def _checked_media_io_kwargs(media_io_kwargs: dict) -> dict[str, dict[str, Any]]:
    """``--media-io-kwargs`` checked against ``MEDIA_IO_OPTIONS``.

    Raises:
        ValueError: an unknown modality or option, or a bad ``num_frames``."""
    for modality, options in media_io_kwargs.items():
        known = MEDIA_IO_OPTIONS.get(modality)
        if known is None or not isinstance(options, dict):
            raise ValueError(f"--media-io-kwargs: {modality!r} takes no options (known: "
                             f"{', '.join(f'{m}: {sorted(o)}' for m, o in MEDIA_IO_OPTIONS.items())}).")
        for name, value in options.items():
            if name not in known:
                raise ValueError(f"--media-io-kwargs: unknown {modality} option {name!r} (known: {', '.join(known)}).")
            if not isinstance(value, int) or isinstance(value, bool) or not (value >= 1 or value == -1):
                raise ValueError(f"--media-io-kwargs: {modality}.{name} must be {known[name]}, got {value!r}.")
    return {m: dict(o) for m, o in media_io_kwargs.items()}
