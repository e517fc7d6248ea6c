"""The Qwen-VL video processors' algorithm (transformers' ``Qwen2VLVideoProcessor`` and
``Qwen3VLVideoProcessor``, which need torchvision) on Pillow and numpy: each frame resized
(bicubic) to the size ``smart_resize`` picks, rescaled to [0, 1] and normalised by the
processor's mean / std, the frames padded to a multiple of ``temporal_patch_size`` by
repeating the last one, and cut into patches in the processor's order:

    pixel_values_videos [grid_t * grid_h * grid_w, C * temporal_patch_size * patch^2]
    video_grid_thw      [grid_t, grid_h, grid_w]   (grid_h = H' / patch, merge blocks consecutive)

Qwen2.5-VL sizes each frame by ``smart_resize`` (multiples of ``patch * merge``, pixels per
frame within [min_pixels, max_pixels]); Qwen3-VL by its temporal variant, whose bounds count
the pixels of all frames. The settings are the checkpoint's video_preprocessor_config.json,
else its image processor's (patch, merge and temporal patch sizes, mean, std, ``size``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


def smart_resize_frames(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's frame size (transformers' ``video_processing_qwen3_vl.smart_resize``): the
    nearest multiples of ``factor``, scaled so that frames x height x width stays within
    [min_pixels, max_pixels].

    Raises:
        ValueError: an aspect ratio over 200.
    """
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenVideoPreprocessor:
    """Frames -> ``pixel_values_videos`` / ``video_grid_thw`` (see the module docstring).

    Args:
        path: the checkpoint folder.
        image_processor: the checkpoint's image processor (the settings' fallback).
        temporal_bounds: Qwen3-VL's sizing (pixel bounds over all frames).
    """

    def __init__(self, path: Path, image_processor: Any, temporal_bounds: bool) -> None:
        config_path = Path(path) / "video_preprocessor_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}

        def setting(key: str) -> Any:
            return config.get(key, getattr(image_processor, key, None))

        self.patch_size = int(setting("patch_size"))
        self.merge_size = int(setting("merge_size"))
        self.temporal_patch_size = int(setting("temporal_patch_size"))
        self.image_mean = np.asarray(setting("image_mean"), dtype=np.float32)
        self.image_std = np.asarray(setting("image_std"), dtype=np.float32)
        self.rescale_factor = float(setting("rescale_factor") or 1 / 255)
        size = dict(config.get("size") or image_processor.size)
        self.min_pixels = int(config.get("min_pixels") or size["shortest_edge"])
        self.max_pixels = int(config.get("max_pixels") or size["longest_edge"])
        self.temporal_bounds = temporal_bounds

    def frame_size(self, num_frames: int, height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """(height, width) each frame is resized to."""
        factor = self.patch_size * self.merge_size
        if self.temporal_bounds:
            return smart_resize_frames(num_frames, height, width, self.temporal_patch_size, factor,
                                       min_pixels, max_pixels)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)

    def __call__(self, frames: np.ndarray, min_pixels: int | None = None, max_pixels: int | None = None
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
        """uint8 frames [T, H, W, 3] -> (pixel_values_videos float32 [P, C * tp * patch^2],
        video_grid_thw (t, h, w)); ``min_pixels`` / ``max_pixels`` over the settings'.

        Raises:
            ValueError: an aspect ratio over 200.
        """
        from PIL import Image

        num_frames, height, width, _ = frames.shape
        new_h, new_w = self.frame_size(num_frames, height, width, min_pixels or self.min_pixels,
                                       max_pixels or self.max_pixels)
        resized = np.stack([np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.BICUBIC)) for f in frames])
        video = (resized.astype(np.float32) * np.float32(self.rescale_factor) - self.image_mean) / self.image_std
        video = video.transpose(0, 3, 1, 2)  # [T, C, H', W']
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -num_frames % tp:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        grid_t, grid_h, grid_w = video.shape[0] // tp, new_h // p, new_w // p
        channels = video.shape[1]
        patches = video.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return (np.ascontiguousarray(patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)),
                (grid_t, grid_h, grid_w))
