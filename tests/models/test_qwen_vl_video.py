"""Videos on Qwen2.5-VL and Qwen3-VL (tiny checkpoints transformers writes): the Pillow / numpy
video preprocessing equals transformers' image processor on a video of repeated frames; greedy
output with a video (and text after it, with an image before it, and a still video) is token-identical to
transformers' float32 ``generate`` given the same ``pixel_values_videos`` / ``video_grid_thw``
(/ ``second_per_grid_ts``), under chunked prefill of 8-token steps; the prompt positions equal
transformers' ``get_rope_index`` (Qwen2.5-VL's time scaling at 1 frame per second); ``LLM.chat``
with a ``video_url`` data: URL (an mp4 PyAV writes) sampled to ``--media-io-kwargs``' frames;
``--limit-mm-per-prompt`` for videos, unreadable bytes and a wrong MIME type refused naming the
part; block and encoder-cache accounting checked at the end; bad ``--media-io-kwargs`` and
offline videos of the wrong form refused."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.processing import QwenVLProcessing
from pagedllm.multimodal.video import as_video, decode_video, sample_frame_indices
from tests.helpers import check_block_accounting
from tests.multimodal.checkpoints import _hf_qwen_vl, make_qwen_vl_checkpoint, random_image

MAX_TOKENS = 5
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_VIDEO = f"Watch {VIDEO} and say what happens next in the clip."
IMAGE_AND_VIDEO = f"The picture {IMAGE} and then the clip {VIDEO}: compare them."
QUESTION = "What is this?"
RENDERED = f"<|im_start|>user\n{VIDEO}\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
ARCHITECTURES = ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"]


def random_frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def make_mp4(frames: np.ndarray, fps: int) -> bytes:
    """An MPEG-4 video of ``frames`` (even sizes) at ``fps``, written by PyAV."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def hf_greedy(path, prompt: str, images: list, videos: list) -> tuple[list[int], dict]:
    """transformers' float32 greedy completion given our processor's tensors (its own video
    processor needs torchvision), and those inputs."""
    _, model = _hf_qwen_vl(path)
    inputs = QwenVLProcessing(path)(text=[prompt], images=images, videos=videos)
    ids = inputs["input_ids"]
    types = torch.zeros_like(ids)
    types[ids == model.config.image_token_id], types[ids == model.config.video_token_id] = 1, 2
    with torch.no_grad():
        out = model.generate(**inputs, mm_token_type_ids=types, attention_mask=torch.ones_like(ids),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist(), {**inputs, "mm_token_type_ids": types}


def test_video_preprocessing_equals_transformers_image_processor(tmp_path_factory):
    """A video of two equal frames is one temporal patch of that frame: the image processor's
    ``pixel_values`` / ``image_grid_thw``; three frames pad to two patches with the last one."""
    from PIL import Image

    path = make_qwen_vl_checkpoint(tmp_path_factory.mktemp("pre"))
    processing = QwenVLProcessing(path)
    frame = random_frames(1, 50, 70, seed=5)[0]
    expected = processing.image_processor(images=[Image.fromarray(frame)], return_tensors="np")
    pixels, grid = processing.video_processor(np.stack([frame, frame]))
    assert [list(grid)] == expected["image_grid_thw"].tolist() == [[1, 6, 8]]
    np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-6)
    frames = random_frames(3, 50, 70, seed=6)
    pixels, grid = processing.video_processor(frames)
    last = processing.image_processor(images=[Image.fromarray(frames[2])], return_tensors="np")["pixel_values"]
    assert grid == (2, 6, 8)
    np.testing.assert_allclose(pixels[48:], last, atol=1e-6)


def test_uniform_frame_sampling():
    assert sample_frame_indices(10, 4).tolist() == [0, 3, 6, 9]
    assert sample_frame_indices(3, 8).tolist() == [0, 1, 2]
    assert sample_frame_indices(5, -1).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_qwen_vl_video_greedy_matches_transformers(tmp_path_factory, architecture):
    from PIL import Image

    path = make_qwen_vl_checkpoint(tmp_path_factory.mktemp(architecture), architecture)
    frames = random_frames(4, 40, 50, seed=1)
    other = [Image.fromarray(f) for f in random_frames(4, 48, 32, seed=2)]
    image = random_image(40, 50, seed=3)
    still = np.repeat(frames[:1], 4, axis=0)  # equal frame pairs: Qwen3-VL's two items share a content hash
    # (prompt, images, multi_modal_data video): an array at the assumed 2 fps; PIL frames at 1 fps.
    cases = [(ONE_VIDEO, [], frames), (ONE_VIDEO, [], (other, {"fps": 1.0})), (IMAGE_AND_VIDEO, [image], frames),
             (ONE_VIDEO, [], still)]
    expected, hf_inputs = zip(*(hf_greedy(path, text, imgs, [as_video(video)]) for text, imgs, video in cases))
    assert expected[0] != expected[1], "the videos do not change the output: the test would not see a bug"
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        assert hf_inputs[1]["second_per_grid_ts"].tolist() == [2.0]
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=8, enable_prefix_caching=True,
              kv_cache_memory_bytes=4 << 20, limit_mm_per_prompt={"video": 1},
              media_io_kwargs={"video": {"num_frames": 4}})
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
    processor = llm.llm_engine.processor
    for (text, imgs, video), inputs in zip(cases, hf_inputs):
        data = {"video": video, **({"image": imgs} if imgs else {})}
        _, token_ids, features = processor.process_multimodal({"prompt": text, "multi_modal_data": data})
        assert token_ids == inputs["input_ids"][0].tolist()
        hf_model = _hf_qwen_vl(path)[1].model
        names = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        positions, delta = hf_model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   **{k: inputs[k] for k in names if k in inputs})
        ours, our_delta = model.get_mrope_input_positions(token_ids, features)
        assert np.array_equal(ours, positions[:, 0].numpy()) and our_delta == int(delta)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"video": video, **({"image": imgs} if imgs else {})}}
               for text, imgs, video in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == list(expected)
    _check_chat(llm, path, params)
    _check_accounting(llm)


def _check_chat(llm: LLM, path, params: SamplingParams) -> None:
    """A ``video_url`` data: URL is decoded and sampled to 4 frames (transformers' reply to the
    rendered prompt with those frames); two videos, unreadable bytes and a wrong MIME type are
    refused, naming the part, and the engine keeps serving."""
    mp4 = make_mp4(random_frames(8, 48, 64, seed=4), fps=4)
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    video = decode_video(mp4, 4)
    assert video.frames_indices == (0, 2, 4, 7) and video.fps == 4.0

    def message(*urls: str) -> list[dict]:
        parts = [{"type": "video_url", "video_url": {"url": u}} for u in urls]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]

    reply, = llm.chat(message(url), params, use_tqdm=False)
    assert list(reply.outputs[0].token_ids) == hf_greedy(path, RENDERED, [], [video])[0]
    with pytest.raises(ValueError, match=r"At most 1 video\(s\)"):
        llm.chat(message(url, url), params, use_tqdm=False)
    bad = "data:video/mp4;base64," + base64.b64encode(b"not a video" * 20).decode()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: the video could not be decoded"):
        llm.chat(message(bad), params, use_tqdm=False)
    png = "data:image/png;base64," + base64.b64encode(mp4).decode()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: .*'image/png', not a video/\* type"):
        llm.chat(message(png), params, use_tqdm=False)
    again, = llm.chat(message(url), params, use_tqdm=False)
    assert again.outputs[0].token_ids == reply.outputs[0].token_ids


def _check_accounting(llm: LLM) -> None:
    check_block_accounting(llm)
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert not any(manager.cached.values()), "an encoder-cache entry is still referenced"
    assert manager.num_free_slots + sum(manager.freeable.values()) == manager.cache_size


@pytest.mark.parametrize(("media_io_kwargs", "message"), [
    ({"audio": {"num_frames": 2}}, "'audio' takes no options"),
    ({"video": {"fps": 2}}, "unknown video option 'fps'"),
    ({"video": {"num_frames": 0}}, "video.num_frames must be an integer >= 1, or -1"),
])  # fmt: skip
def test_bad_media_io_kwargs_are_refused(media_io_kwargs, message):
    from pagedllm.config.multimodal import MultiModalConfig

    with pytest.raises(ValueError, match=message):
        MultiModalConfig.from_engine_args(None, None, False, None, None, media_io_kwargs)
    config = MultiModalConfig.from_engine_args({"video": 1}, None, False, None, None, {"video": {"num_frames": -1}})
    assert config.video_num_frames == -1 and config.limit_per_prompt == {"video": 1}


def test_bad_offline_videos_are_refused():
    with pytest.raises(ValueError, match=r"uint8 \[T, H, W, 3\]"):
        as_video(np.zeros((2, 8, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="not a str"):
        as_video("clip.mp4")
    with pytest.raises(ValueError, match="2 frames_indices for 3 frames"):
        as_video((random_frames(3, 8, 8, seed=0), {"fps": 4.0, "frames_indices": [0, 1]}))
    video = as_video((random_frames(3, 8, 8, seed=0), {"fps": 4.0, "frames_indices": [0, 4, 8], "total_num_frames": 9}))
    assert video.sampled_fps == 3 / 9 * 4.0
