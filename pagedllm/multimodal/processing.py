"""A prompt with images -> its token ids (each image's placeholder token expanded to the run
its embeddings fill) and one ``MultiModalFeatureSpec`` per image, through the checkpoint's
own transformers processor (``AutoProcessor``: resizing, normalisation and the placeholder
expansion are the model's, as vLLM's ``BaseMultiModalProcessor`` applies the HF processor).

An architecture's ``ItemLayout`` says how the processor's batched tensors split into items
and how many placeholder tokens each fills; ``MULTIMODAL_LAYOUTS`` lists the image-text
architectures the engine serves with their vision encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from pagedllm.multimodal.hasher import hash_item
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData


@dataclass(frozen=True)
class ItemLayout:
    """How one architecture's processor output splits into images.

    Attributes:
        image_token_key: the config key holding the image placeholder token id (the token the
            processor repeats, one per embedding).
        split: (processor output, number of images) -> each image's tensors.
        prompt_token_key: the config key holding the token a prompt (and the chat template)
            writes for an image, when it is not the placeholder (Gemma 3's ``<start_of_image>``,
            which the processor expands to its image tokens); None: the placeholder itself.
    """

    image_token_key: str
    split: Callable[[Mapping[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
    prompt_token_key: Optional[str] = None


def _split_batched(outputs: Mapping[str, torch.Tensor], num_items: int) -> list[dict[str, torch.Tensor]]:
    """Llava's and Gemma 3's layout (without pan-and-scan crops): ``pixel_values`` [N, 3, H, W],
    image i is row i."""
    pixel_values = outputs["pixel_values"]
    if pixel_values.shape[0] != num_items:
        raise ValueError(f"the processor made {pixel_values.shape[0]} images of {num_items}")
    return [{"pixel_values": pixel_values[i : i + 1]} for i in range(num_items)]


#: Architecture -> its ``ItemLayout`` (the image-text models served with their vision encoder).
MULTIMODAL_LAYOUTS: dict[str, ItemLayout] = {
    "LlavaForConditionalGeneration": ItemLayout("image_token_index", _split_batched),
    "Gemma3ForConditionalGeneration": ItemLayout("image_token_index", _split_batched, "boi_token_index"),
}


def placeholder_ranges(token_ids: Sequence[int], token_id: int, lengths: Sequence[int]) -> list[PlaceholderRange]:
    """The positions of each item's placeholder tokens: the runs of ``token_id`` in
    ``token_ids``, taken in order, ``lengths[i]`` tokens for item i (adjacent images share a run).

    Raises:
        ValueError: the runs do not hold exactly ``sum(lengths)`` tokens in items' lengths.
    """
    positions = [i for i, t in enumerate(token_ids) if t == token_id]
    if len(positions) != sum(lengths):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens for {len(lengths)} image(s) "
                         f"of {sum(lengths)} tokens in all")
    ranges, start = [], 0
    for length in lengths:
        run = positions[start : start + length]
        if run[-1] - run[0] != length - 1:
            raise ValueError("an image's placeholder tokens are not contiguous in the prompt")
        ranges.append(PlaceholderRange(run[0], length))
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
    """

    def __init__(self, model_path: Path, architecture: str, hf_config: Any, trust_remote_code: bool = False,
                 default_kwargs: Optional[dict] = None) -> None:
        from transformers import AutoProcessor

        self.layout = MULTIMODAL_LAYOUTS[architecture]
        self.image_token_id = int(getattr(hf_config, self.layout.image_token_key))
        self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.default_kwargs = dict(default_kwargs or {})

    def apply(self, prompt: str, images: Sequence[Any], mm_processor_kwargs: Optional[dict] = None,
              add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(token ids, one feature per image in prompt order) of ``prompt`` (its image
        placeholders as the model's chat template writes them, e.g. ``<image>``) with ``images``
        (PIL images); ``add_special_tokens`` as the tokenizer's.

        Raises:
            ValueError: the processor refuses the input (an image it cannot read, a count of
                placeholders that differs from the images') or an unknown option; the message
                says which.
        """
        kwargs = {**self.default_kwargs, **(mm_processor_kwargs or {})}
        try:
            outputs = self.processor(text=[prompt], images=list(images), return_tensors="pt",
                                     add_special_tokens=add_special_tokens, **kwargs)
        except (ValueError, TypeError, OSError, IndexError) as exc:
            raise ValueError(f"The model's processor could not process the prompt's images: {exc}") from None
        token_ids = outputs["input_ids"][0].tolist()
        items = self.layout.split(outputs, len(images))
        try:
            lengths = [self._num_placeholders(token_ids, len(items))] * len(items)
            ranges = placeholder_ranges(token_ids, self.image_token_id, lengths)
        except ValueError as exc:
            raise ValueError(f"The prompt does not match its images: {exc}.") from None
        features = [
            MultiModalFeatureSpec("image", hash_item(item), position,
                                  {name: TensorData.from_tensor(t) for name, t in item.items()})
            for item, position in zip(items, ranges)
        ]
        return token_ids, features

    def _num_placeholders(self, token_ids: list[int], num_items: int) -> int:
        """Placeholder tokens per image of a layout whose images all fill the same number."""
        total = sum(t == self.image_token_id for t in token_ids)
        if num_items == 0 or total % num_items:
            raise ValueError(f"{total} image placeholder tokens for {num_items} image(s)")
        return total // num_items
