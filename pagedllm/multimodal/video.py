"""Videos into the engine: decoding with PyAV and uniform frame sampling (vLLM's video loader:
``num_frames`` frames at ``np.linspace(0, total - 1, num_frames)``, all of them when the
video has fewer, or with ``num_frames`` -1), and the offline forms of a video
(``multi_modal_data={"video": ...}``) as one ``VideoData``.

A video is its frames, uint8 [T, H, W, 3] RGB, with its metadata: the source's ``fps``, its
``total_num_frames`` and the sampled ``frames_indices`` (what the Qwen-VL processors read for
``second_per_grid_ts`` and frame timestamps). Frames given without metadata are taken as
sampled at ``ASSUMED_FPS`` frames per second, indices 0 .. T - 1.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.multimodal.media import MediaError

#: Frames a decoded video is sampled to when ``--media-io-kwargs`` sets none (vLLM's default).
DEFAULT_NUM_FRAMES = 32
#: The frame rate of frames given without metadata (the Qwen-VL processors' sampling rate).
ASSUMED_FPS = 2.0


@dataclass(frozen=True)
class VideoData:
    """One video: ``frames`` uint8 [T, H, W, 3]; ``fps`` of the source; ``total_num_frames`` of
    the source; ``frames_indices`` (T source indices of the frames)."""

    frames: np.ndarray
    fps: float
    total_num_frames: int
    frames_indices: tuple[int, ...]

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames (transformers' ``VideoMetadata.sampled_fps``)."""
        return len(self.frames_indices) / self.total_num_frames * self.fps


def sample_frame_indices(total_num_frames: int, num_frames: int) -> np.ndarray:
    """Uniform sampling: ``num_frames`` indices from 0 to ``total_num_frames - 1`` (linspace,
    truncated), or all frames when ``num_frames`` is -1 or at least the total."""
    if num_frames == -1 or num_frames >= total_num_frames:
        return np.arange(total_num_frames)
    return np.linspace(0, total_num_frames - 1, num_frames, dtype=int)


def decode_video(data: bytes, num_frames: int = DEFAULT_NUM_FRAMES) -> VideoData:
    """The frames of an encoded video (any container and codec PyAV's FFmpeg reads), sampled
    to ``num_frames`` (``sample_frame_indices``), RGB.

    Raises:
        MediaError: not a readable video, or one with no video stream or no frames.
    """
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            rate = stream.average_rate or stream.guessed_rate
    except av.FFmpegError as exc:
        raise MediaError(f"the video could not be decoded ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise MediaError("the video has no frames")
    indices = sample_frame_indices(len(frames), num_frames)
    fps = float(rate) if rate else ASSUMED_FPS
    return VideoData(np.stack([frames[i] for i in indices]), fps, len(frames), tuple(int(i) for i in indices))


def as_video(item: Any) -> VideoData:
    """A ``VideoData`` of an offline video: a ``VideoData``; a uint8 array [T, H, W, 3]; a list
    of PIL images (all one size); or a pair (either of those, metadata dict with ``fps`` and
    optionally ``total_num_frames`` / ``frames_indices``, as vLLM's (frames, metadata) items).

    Raises:
        ValueError: anything else; an array of another shape or dtype; frames of different sizes.
    """
    if isinstance(item, VideoData):
        return item
    metadata: dict[str, Any] = {}
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
        item, metadata = item
    frames = _frames_array(item)
    count = frames.shape[0]
    indices = tuple(int(i) for i in metadata.get("frames_indices", range(count)))
    if len(indices) != count:
        raise ValueError(f"a video's metadata has {len(indices)} frames_indices for {count} frames")
    return VideoData(frames, float(metadata.get("fps", ASSUMED_FPS)),
                     int(metadata.get("total_num_frames", max(indices) + 1)), indices)


def _frames_array(item: Any) -> np.ndarray:
    from PIL import Image

    if isinstance(item, (list, tuple)) and item and all(isinstance(f, Image.Image) for f in item):
        if len({f.size for f in item}) != 1:
            raise ValueError("a video's PIL frames are not all one size")
        return np.stack([np.asarray(f.convert("RGB")) for f in item])
    if isinstance(item, np.ndarray):
        if item.ndim != 4 or item.shape[-1] != 3 or item.dtype != np.uint8 or item.shape[0] == 0:
            raise ValueError(f"a video array must be uint8 [T, H, W, 3] with T > 0, got {item.dtype} {list(item.shape)}")
        return item
    raise ValueError(f"a video is a uint8 array [T, H, W, 3] or a list of PIL images, not a {type(item).__name__}")
