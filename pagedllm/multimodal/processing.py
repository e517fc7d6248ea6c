"""A prompt with images -> its token ids (each image's placeholder token expanded to the run
its embeddings fill) and one ``MultiModalFeatureSpec`` per image, through the checkpoint's
own transformers processor (``AutoProcessor``: resizing, normalisation and the placeholder
expansion are the model's, as vLLM's ``BaseMultiModalProcessor`` applies the HF processor).

An architecture's ``ItemLayout`` says how the processor's batched tensors split into items
and how many placeholder tokens each fills; ``MULTIMODAL_LAYOUTS`` lists the image-text
architectures the engine serves with their vision encoder.

The Qwen-VL processors load their video processor, which needs torchvision, with their image
one; ``QwenVLProcessing`` is their rules without it, from the checkpoint's image processor and
tokenizer and ``pagedllm.multimodal.qwen_video`` for videos (transformers'
``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor``: each image placeholder expanded to
``grid_thw.prod() / merge_size^2`` tokens; each ``<|video_pad|>`` to the video's tokens,
Qwen2.5-VL with ``second_per_grid_ts`` = temporal_patch_size / sampled fps, Qwen3-VL one
``<t seconds><|vision_start|>...<|vision_end|>`` per temporal patch, each of which is then an
item of its own: the tower attends within a frame group, so it encodes the same embeddings).
transformers' ``PixtralProcessor`` (Mistral 3) needs torchvision too; ``PixtralImageProcessing``
is the same rule on the checkpoint's image processor (its Pillow variant without torchvision)
and tokenizer.

Gemma 3's pan-and-scan (``mm_processor_kwargs={"do_pan_and_scan": True}``, per request with
``--trust-request-mm-kwargs`` or server-wide with ``--mm-processor-kwargs``): its processor
cuts a wide or tall image into crops and writes a placeholder run for the thumbnail and for
each crop; each becomes an item (``MultiModalFeatureSpec``) of its own.

An image's placeholder run may hold tokens that keep their own embedding (Pixtral's
[IMG_BREAK] after each row of [IMG] tokens and [IMG_END] last): its ``PlaceholderRange``
then covers the whole run and flags the image-token positions in ``is_embed``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from pagedllm.multimodal.hasher import hash_item
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData


def _auto_processor(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class ItemLayout:
    """How one architecture's processor output splits into images.

    Attributes:
        image_token_key: the config key holding the image placeholder token id (the token the
            processor repeats, one per embedding).
        split: (processor output, number of images) -> each item's tensors: an item is an
            image, or one of the crops an image becomes (Gemma 3's pan-and-scan), each with
            its own placeholder run.
        item_tokens: (an image's tensors, the model's config) -> its placeholder tokens (None:
            every image of a prompt fills the same number).
        chat_placeholder: the text a chat message gets per image (None: the image token's).
        load_processor: (checkpoint folder, trust_remote_code) -> the processor.
        prompt_token_key: the config key holding the token a prompt (and the chat template)
            writes for an image, when it is not the placeholder (Gemma 3's ``<start_of_image>``,
            which the processor expands to its image tokens); None: the placeholder itself.
        run_token_ids: the processor -> the other token ids inside an image's placeholder run,
            which keep their own embedding (Pixtral's [IMG_BREAK], [IMG_END]); None: the run is
            the image token alone. ``item_tokens`` then counts the whole run.
        video_token_key: the config key of the video placeholder token (None: no videos).
        split_videos: (processor output, number of videos) -> each video item's tensors.
        video_chat_placeholder: the text a chat message gets per video.
    """

    image_token_key: str
    split: Callable[[Mapping[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
    item_tokens: Optional[Callable[[Mapping[str, torch.Tensor], Any], int]] = None
    chat_placeholder: Optional[str] = None
    load_processor: Callable[[Path, bool], Any] = _auto_processor

    prompt_token_key: Optional[str] = None
    run_token_ids: Optional[Callable[[Any], Sequence[int]]] = None
    video_token_key: Optional[str] = None
    split_videos: Optional[Callable[[Mapping[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]] = None
    video_chat_placeholder: Optional[str] = None


def _expand(prompt: str, token: str, runs: Sequence[str], what: str) -> str:
    """``prompt`` with its i-th ``token`` replaced by ``runs[i]``.

    Raises:
        ValueError: the prompt's ``token``s are not one per run."""
    pieces = prompt.split(token)
    if len(pieces) - 1 != len(runs):
        raise ValueError(f"the prompt has {len(pieces) - 1} {token} placeholders for {len(runs)} {what}(s)")
    return pieces[0] + "".join(run + piece for run, piece in zip(runs, pieces[1:]))


class QwenVLProcessing:
    """The Qwen-VL processors (see the module docstring), called as the processor:
    ``(text=[prompt], images=[...], videos=[VideoData ...], return_tensors="pt",
    add_special_tokens=..., **kwargs)`` -> ``input_ids`` [1, L]; with images ``pixel_values``
    [sum of patches, C * temporal_patch * patch^2] and ``image_grid_thw`` [N, 3]; with videos
    ``pixel_values_videos`` [sum of patches, same width], ``video_grid_thw`` [V, 3] and
    (Qwen2.5-VL) ``second_per_grid_ts`` [V] float32; ``kwargs`` (``min_pixels``,
    ``max_pixels``, ``size`` ...) go to the image processor.

    Raises (when called):
        ValueError: the prompt's image (video) tokens are not one per image (video).
    """

    def __init__(self, path: Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        from pagedllm.multimodal.qwen_video import QwenVideoPreprocessor

        self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(self.tokenizer, "video_token", None) or "<|video_pad|>"
        self.timestamps = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type == "qwen3_vl"
        self.video_processor = QwenVideoPreprocessor(path, self.image_processor, temporal_bounds=self.timestamps)

    def __call__(self, text: list[str], images: Sequence[Any] = (), return_tensors: str = "pt",
                 add_special_tokens: bool = True, videos: Sequence[Any] = (), **kwargs: Any) -> dict[str, torch.Tensor]:
        outputs: dict[str, torch.Tensor] = {}
        prompt = text[0]
        if images:
            kwargs = self._pixel_bounds_as_size(kwargs)
            outputs.update(self.image_processor(images=list(images), return_tensors=return_tensors, **kwargs))
            merge = kwargs.get("merge_size") or self.image_processor.merge_size
            counts = (outputs["image_grid_thw"].prod(-1) // merge**2).tolist()
            prompt = _expand(prompt, self.image_token, [self.image_token * n for n in counts], "image")
        elif self.image_token in prompt:
            prompt = _expand(prompt, self.image_token, [], "image")
        if videos or self.video_token in prompt:
            runs, video_outputs = self._videos(videos)
            prompt = _expand(prompt, self.video_token, runs, "video")
            outputs.update(video_outputs)
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": torch.tensor([ids]), **outputs}

    def _videos(self, videos: Sequence[Any]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Each video's placeholder text and the videos' tensors (see the class docstring)."""
        if not videos:
            return [], {}
        vp = self.video_processor
        runs, pixels, grids, seconds = [], [], [], []
        for video in videos:
            patches, grid = vp(video.frames)
            pixels.append(torch.from_numpy(patches))
            grids.append(grid)
            frame_tokens = grid[1] * grid[2] // vp.merge_size**2
            if self.timestamps:
                runs.append("".join(f"<{t:.1f} seconds><|vision_start|>{self.video_token * frame_tokens}<|vision_end|>"
                                    for t in self._group_timestamps(video)))
            else:
                runs.append(self.video_token * (grid[0] * frame_tokens))
                seconds.append(vp.temporal_patch_size / video.sampled_fps)
        outputs = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
        if not self.timestamps:
            outputs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return runs, outputs

    def _group_timestamps(self, video: Any) -> list[float]:
        """Seconds of each temporal patch: the mean of its first and last frame's time
        (transformers' ``Qwen3VLProcessor._calculate_timestamps``; the last index repeated to
        fill the last patch)."""
        group = self.video_processor.temporal_patch_size
        indices = list(video.frames_indices)
        indices += [indices[-1]] * (-len(indices) % group)
        times = [i / video.fps for i in indices]
        return [(times[i] + times[i + group - 1]) / 2 for i in range(0, len(times), group)]

    def _pixel_bounds_as_size(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``min_pixels`` / ``max_pixels`` (vLLM's and the Qwen model cards' options) as the
        image processor's ``size`` {"shortest_edge", "longest_edge"} (its current spelling)."""
        if "min_pixels" not in kwargs and "max_pixels" not in kwargs:
            return kwargs
        kwargs = dict(kwargs)
        size = dict(kwargs.pop("size", None) or self.image_processor.size)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if kwargs.get(key) is not None:
                size[edge] = kwargs.pop(key)
            kwargs.pop(key, None)
        return {**kwargs, "size": size}


class PixtralImageProcessing:
    """transformers' ``PixtralProcessor`` for images (see the module docstring), called as the
    processor: ``(text=[prompt], images=[...], return_tensors="pt", add_special_tokens=...,
    **kwargs)`` -> ``input_ids`` [1, L], ``pixel_values`` [N, C, H_max, W_max] (padded to the
    largest image) and ``image_sizes`` [N, 2] (height, width in pixels, multiples of
    ``patch_size * spatial_merge_size``); ``kwargs`` (``size`` ...) go to the image processor.
    Each ``image_token`` of the prompt becomes, per row of the image's tokens, one
    ``image_token`` per column then ``image_break_token``, the last break ``image_end_token``.
    ``patch_size``, ``spatial_merge_size`` and the three tokens are processor_config.json's,
    else the model's config.json (``vision_config.patch_size``, ``spatial_merge_size``) and
    transformers' defaults ([IMG], [IMG_BREAK], [IMG_END]).

    Raises (when called):
        ValueError: the prompt's image tokens are not one per image.
    """

    def __init__(self, path: Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        options_path = Path(path) / "processor_config.json"
        options = json.loads(options_path.read_text()) if options_path.is_file() else {}
        if "patch_size" not in options or "spatial_merge_size" not in options:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            options = {"patch_size": config.vision_config.patch_size,
                       "spatial_merge_size": config.spatial_merge_size, **options}
        self.token_side = int(options["patch_size"]) * int(options["spatial_merge_size"])
        self.image_token = options.get("image_token", "[IMG]")
        self.image_break_token = options.get("image_break_token", "[IMG_BREAK]")
        self.image_end_token = options.get("image_end_token", "[IMG_END]")
        #: The ids of [IMG_BREAK] and [IMG_END] (the run's tokens besides [IMG]).
        self.run_token_ids = tuple(self.tokenizer.convert_tokens_to_ids(t)
                                   for t in (self.image_break_token, self.image_end_token))

    def __call__(self, text: list[str], images: list, return_tensors: str = "pt", add_special_tokens: bool = True,
                 **kwargs: Any) -> dict[str, torch.Tensor]:
        outputs = dict(self.image_processor(images=images, return_tensors=return_tensors,
                                            patch_size=self.token_side, **kwargs))
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} placeholders for {len(images)} image(s)")
        runs = [self._run(int(h), int(w)) for h, w in outputs["image_sizes"].tolist()]
        prompt = pieces[0] + "".join(run + piece for run, piece in zip(runs, pieces[1:]))
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": torch.tensor([ids]), **outputs}

    def _run(self, height: int, width: int) -> str:
        rows, cols = height // self.token_side, width // self.token_side
        row = self.image_token * cols + self.image_break_token
        return row * (rows - 1) + self.image_token * cols + self.image_end_token


def _split_by_sizes(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Pixtral's layout: ``pixel_values`` [N, C, H_max, W_max], image i row i cropped to its
    ``image_sizes[i]`` (the padding of the batch is not the image's); ``image_sizes`` [N, 2]."""
    sizes = outputs["image_sizes"]
    if sizes.shape[0] != num_items:
        raise ValueError(f"the processor made {sizes.shape[0]} images of {num_items}")
    items = []
    for i, (height, width) in enumerate(sizes.tolist()):
        pixels = outputs["pixel_values"][i : i + 1, :, :height, :width].contiguous()
        items.append({"pixel_values": pixels, "image_sizes": sizes[i : i + 1]})
    return items


def _pixtral_run_tokens(item: Mapping[str, torch.Tensor], hf_config: Any) -> int:
    """An image's run: rows x (columns + 1) tokens (one [IMG_BREAK] / [IMG_END] per row)."""
    vision = hf_config.vision_config
    side = (vision["patch_size"] if isinstance(vision, dict) else vision.patch_size) * hf_config.spatial_merge_size
    height, width = item["image_sizes"][0].tolist()
    return (height // side) * (width // side + 1)


def _split_by_grid(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Qwen-VL's layout: ``pixel_values`` [sum of patches, ...], image i the next
    ``image_grid_thw[i].prod()`` rows; ``image_grid_thw`` [N, 3]."""
    grids = outputs["image_grid_thw"]
    if grids.shape[0] != num_items:
        raise ValueError(f"the processor made {grids.shape[0]} images of {num_items}")
    sizes = grids.prod(-1).tolist()
    pixels = outputs["pixel_values"].split(sizes)
    return [{"pixel_values": pixels[i], "image_grid_thw": grids[i : i + 1]} for i in range(num_items)]


def _grid_tokens(item: Mapping[str, torch.Tensor], hf_config: Any) -> int:
    vision = hf_config.vision_config
    merge = vision["spatial_merge_size"] if isinstance(vision, dict) else vision.spatial_merge_size
    grid = item["image_grid_thw"] if "image_grid_thw" in item else item["video_grid_thw"]
    return int(grid.prod()) // merge**2


def _split_videos_by_grid(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Qwen2.5-VL's videos: ``pixel_values_videos`` [sum of patches, ...], video i the next
    ``video_grid_thw[i].prod()`` rows, with its ``second_per_grid_ts[i]``."""
    grids = outputs["video_grid_thw"]
    if grids.shape[0] != num_items:
        raise ValueError(f"the processor made {grids.shape[0]} videos of {num_items}")
    pixels = outputs["pixel_values_videos"].split(grids.prod(-1).tolist())
    seconds = outputs["second_per_grid_ts"]
    return [{"pixel_values_videos": pixels[i], "video_grid_thw": grids[i : i + 1],
             "second_per_grid_ts": seconds[i : i + 1]} for i in range(num_items)]


def _split_video_frames(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Qwen3-VL's videos: one item per temporal patch (its own run between timestamps), grid
    (1, h, w), in prompt order."""
    items = []
    for video in _split_videos_by_grid({**outputs, "second_per_grid_ts": torch.zeros(num_items)}, num_items):
        t, h, w = video["video_grid_thw"][0].tolist()
        grid = torch.tensor([[1, h, w]])
        items += [{"pixel_values_videos": frames, "video_grid_thw": grid}
                  for frames in video["pixel_values_videos"].split(h * w)]
    return items


def _split_batched(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Llava's layout: ``pixel_values`` [N, 3, H, W], image i is row i."""
    pixel_values = outputs["pixel_values"]
    if pixel_values.shape[0] != num_items:
        raise ValueError(f"the processor made {pixel_values.shape[0]} images of {num_items}")
    return [{"pixel_values": pixel_values[i : i + 1]} for i in range(num_items)]


def _split_crops(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Gemma 3's layout: ``pixel_values`` [R, 3, H, W], one row per placeholder run in prompt
    order: an image's row, or with pan-and-scan (``do_pan_and_scan``) its thumbnail then its
    crops (transformers' ``Gemma3Processor`` writes a run for each), so R >= N. Each row is an
    item of its own: its run, its encoder-cache entry, its bidirectional attention range."""
    pixel_values = outputs["pixel_values"]
    if pixel_values.shape[0] < num_items:
        raise ValueError(f"the processor made {pixel_values.shape[0]} images of {num_items}")
    return [{"pixel_values": pixel_values[i : i + 1]} for i in range(pixel_values.shape[0])]


def _qwen_vl_layout(split_videos: Callable[[Mapping[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
                    ) -> ItemLayout:
    return ItemLayout("image_token_id", _split_by_grid, _grid_tokens, "<|vision_start|><|image_pad|><|vision_end|>",
                      QwenVLProcessing, video_token_key="video_token_id", split_videos=split_videos,
                      video_chat_placeholder="<|vision_start|><|video_pad|><|vision_end|>")


#: Architecture -> its ``ItemLayout`` (the image-text models served with their vision encoder).
MULTIMODAL_LAYOUTS: dict[str, ItemLayout] = {
    "LlavaForConditionalGeneration": ItemLayout("image_token_index", _split_batched),
    "Qwen2_5_VLForConditionalGeneration": _qwen_vl_layout(_split_videos_by_grid),
    "Qwen3VLForConditionalGeneration": _qwen_vl_layout(_split_video_frames),
    "Gemma3ForConditionalGeneration": ItemLayout("image_token_index", _split_crops,
                                                 prompt_token_key="boi_token_index"),
    "Mistral3ForConditionalGeneration": ItemLayout(
        "image_token_index", _split_by_sizes, _pixtral_run_tokens, load_processor=PixtralImageProcessing,
        run_token_ids=lambda processor: processor.run_token_ids),
}


def placeholder_ranges(token_ids: Sequence[int], token_id: int, lengths: Sequence[int],
                       run_token_ids: Sequence[int] = ()) -> list[PlaceholderRange]:
    """The positions of each item's placeholder tokens: the runs of ``token_id`` (and of
    ``run_token_ids``, the tokens inside a run that keep their own embedding) in
    ``token_ids``, taken in order, ``lengths[i]`` tokens for item i (adjacent images share a
    run); a range holding ``run_token_ids`` flags its ``token_id`` positions in ``is_embed``.

    Raises:
        ValueError: the runs do not hold exactly ``sum(lengths)`` tokens in items' lengths.
    """
    run_ids = {token_id, *run_token_ids}
    positions = [i for i, t in enumerate(token_ids) if t in run_ids]
    if len(positions) != sum(lengths):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens for {len(lengths)} image(s) "
                         f"of {sum(lengths)} tokens in all")
    ranges, start = [], 0
    for length in lengths:
        run = positions[start : start + length]
        if run[-1] - run[0] != length - 1:
            raise ValueError("an image's placeholder tokens are not contiguous in the prompt")
        is_embed = tuple(token_ids[p] == token_id for p in run)
        ranges.append(PlaceholderRange(run[0], length, None if all(is_embed) else is_embed))
        start += length
    return ranges


class MultiModalProcessor:
    """Applies the checkpoint's transformers processor to a prompt and its images.

    Args:
        model_path: the checkpoint folder (its processor_config.json / preprocessor_config.json).
        architecture: a key of ``MULTIMODAL_LAYOUTS``.
        hf_config: the model's config (it holds the placeholder token id).
        trust_remote_code: passed to ``AutoProcessor``.
        default_kwargs: ``--mm-processor-kwargs``: options of every call (a request's own
            ``mm_processor_kwargs`` go over them).
        max_tokens_per_item: the most embeddings an image may have (the encoder cache's
            size; None: no limit).
    """

    def __init__(self, model_path: Path, architecture: str, hf_config: Any, trust_remote_code: bool = False,
                 default_kwargs: Optional[dict] = None, max_tokens_per_item: Optional[int] = None) -> None:
        self.layout = MULTIMODAL_LAYOUTS[architecture]
        self.hf_config = hf_config
        self.image_token_id = int(getattr(hf_config, self.layout.image_token_key))
        self.processor = self.layout.load_processor(model_path, trust_remote_code)
        self.run_token_ids = tuple(self.layout.run_token_ids(self.processor)) if self.layout.run_token_ids else ()
        self.default_kwargs = dict(default_kwargs or {})
        self.max_tokens_per_item = max_tokens_per_item

    @property
    def takes_videos(self) -> bool:
        """Whether the model takes videos (its layout has a video placeholder)."""
        return self.layout.video_token_key is not None

    def apply(self, prompt: str, images: Sequence[Any], mm_processor_kwargs: Optional[dict] = None,
              add_special_tokens: bool = True, videos: Sequence[Any] = ()
              ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(token ids, one feature per item in prompt order: per image, or per crop of an image
        the processor cuts, Gemma 3's pan-and-scan; per video, or per temporal patch of one,
        Qwen3-VL's) of ``prompt`` (its image and video placeholders as the model's chat
        template writes them, e.g. ``<image>``) with ``images`` (PIL images) and ``videos``
        (``pagedllm.multimodal.video.VideoData``); ``add_special_tokens`` as the tokenizer's.

        Raises:
            ValueError: the processor refuses the input (an image it cannot read, a count of
                placeholders that differs from the images') or an unknown option; videos for a
                model without them; an item of more than ``max_tokens_per_item`` tokens; the
                message says which.
        """
        kwargs = {**self.default_kwargs, **(mm_processor_kwargs or {})}
        if videos:
            if not self.takes_videos:
                raise ValueError("This model does not take videos.")
            kwargs["videos"] = list(videos)
        try:
            outputs = self.processor(text=[prompt], images=list(images), return_tensors="pt",
                                     add_special_tokens=add_special_tokens, **kwargs)
        except (ValueError, TypeError, OSError, IndexError) as exc:
            raise ValueError(f"The model's processor could not process the prompt's images: {exc}") from None
        token_ids = outputs["input_ids"][0].tolist()
        features = self._features("image", token_ids, self.layout.split(outputs, len(images)) if images else [],
                                  self.image_token_id, self.run_token_ids)
        if videos:
            video_token_id = int(getattr(self.hf_config, self.layout.video_token_key))
            features += self._features("video", token_ids, self.layout.split_videos(outputs, len(videos)),
                                       video_token_id, ())
        return token_ids, sorted(features, key=lambda f: f.mm_position.offset)

    def _features(self, modality: str, token_ids: list[int], items: list[dict[str, torch.Tensor]], token_id: int,
                  run_token_ids: Sequence[int]) -> list[MultiModalFeatureSpec]:
        """The items' features, placed at the runs of ``token_id`` (see ``apply``)."""
        if not items:
            return []
        try:
            if self.layout.item_tokens is None:
                lengths = [self._num_placeholders(token_ids, len(items))] * len(items)
            else:
                lengths = [self.layout.item_tokens(item, self.hf_config) for item in items]
            ranges = placeholder_ranges(token_ids, token_id, lengths, run_token_ids)
        except ValueError as exc:
            raise ValueError(f"The prompt does not match its {modality}s: {exc}.") from None
        limit = self.max_tokens_per_item
        largest = max((r.num_embeds for r in ranges), default=0)
        if limit is not None and largest > limit:
            article = "An" if modality == "image" else "A"
            raise ValueError(f"{article} {modality} of {largest} tokens is larger than the encoder cache ({limit} embeddings, "
                             f"--max-num-batched-tokens): send a smaller {modality} or lower max_pixels"
                             + (" or num_frames." if modality == "video" else "."))
        return [
            MultiModalFeatureSpec(modality, hash_item(item), position,
                                  {name: TensorData.from_tensor(t) for name, t in item.items()})
            for item, position in zip(items, ranges)
        ]

    def placeholder_text(self) -> str:
        """The text a prompt writes for one image: the layout's ``chat_placeholder``, else the
        token of its ``prompt_token_key`` (or ``image_token_key``)."""
        if self.layout.chat_placeholder is not None:
            return self.layout.chat_placeholder
        token_id = int(getattr(self.hf_config, self.layout.prompt_token_key or self.layout.image_token_key))
        return self.processor.tokenizer.convert_ids_to_tokens(token_id)

    def _num_placeholders(self, token_ids: list[int], num_items: int) -> int:
        """Placeholder tokens per image of a layout whose images all fill the same number."""
        total = sum(t == self.image_token_id for t in token_ids)
        if num_items == 0 or total % num_items:
            raise ValueError(f"{total} image placeholder tokens for {num_items} image(s)")
        return total // num_items
