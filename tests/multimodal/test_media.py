"""``decode_image``: every unreadable input is a ``MediaError`` whose message says why, in
words a client can act on."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from pagedllm.multimodal.media import MediaError, decode_image


def _png(size=(5, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def test_a_png_decodes_to_rgb():
    image = decode_image(_png())
    assert image.mode == "RGB" and image.size == (5, 3) and image.getpixel((4, 2)) == (10, 200, 30)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"not an image at all", "not a format Pillow reads"),
        (b"", "not a format Pillow reads"),
        (_png()[:40], "could not be decoded"),  # a truncated PNG
    ],
)
def test_unreadable_bytes_say_why_without_python_internals(data, reason):
    with pytest.raises(MediaError, match="could not be decoded") as info:
        decode_image(data)
    assert reason in str(info.value) and "BytesIO" not in str(info.value) and "0x" not in str(info.value)
