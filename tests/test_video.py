"""Videos of MiniMax-M3 VL against transformers 5.23: the processor (ids, pixels, grids, timestamps).

The reference is transformers' real ``MiniMaxM3VLProcessor`` / ``MiniMaxM3VLVideoProcessor`` run through
tests/support/torchvision_shim.py (as in tests/test_vl_processor_reference.py), with the demo tokenizer (509 ids) plus the
four vision tokens as added ids 509-512. transformers writes timestamps only from ``video_metadata`` holding
``fps`` and ``frames_indices`` (what its decoders return): ours from ``video_fps``. transformers' processor passes
``do_resize=False`` to its video processor: frame sizes that need resizing are compared with
``videos_kwargs={"do_resize": True}`` (see `jax_sparse_kv.multimodal.processor`).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import jax_sparse_kv.multimodal as mm

IMAGE, IMAGE_START, IMAGE_END, VIDEO = "]<]image[>[", "]<]start of image[>[", "]<]end of image[>[", "]<]video[>["


def _frames(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tokenizer():
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    tok = TextTokenizer.demo(509).tokenizer
    assert tok.add_special_tokens([IMAGE, IMAGE_START, IMAGE_END, VIDEO]) == 4
    assert [tok.token_to_id(t) for t in (IMAGE, IMAGE_START, IMAGE_END, VIDEO)] == [509, 510, 511, 512]
    return tok


@pytest.fixture(scope="module")
def hf_classes():
    """transformers' processor classes, usable while this module's tests run (the torchvision shim installed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import transformers
    from support import torchvision_shim

    with torchvision_shim.installed(), pytest.MonkeyPatch.context() as patch:
        from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
        from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
        from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
        from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

        for cls in (MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor, VideoProcessorMixin, BaseVideoProcessor):
            patch.setattr(transformers, cls.__name__, cls, raising=False)
        video_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
        patch.setattr(transformers, "VIDEO_PROCESSOR_MAPPING", video_auto.VIDEO_PROCESSOR_MAPPING, raising=False)
        yield MiniMaxM3VLProcessor, MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor


@pytest.fixture(scope="module")
def hf_processor(hf_classes, tokenizer):
    from transformers import PreTrainedTokenizerFast

    processor_cls, image_cls, video_cls = hf_classes
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return processor_cls(image_processor=image_cls(), tokenizer=fast, video_processor=video_cls())


def _np(x) -> np.ndarray:
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _metadata(t: int, fps: float | None) -> dict:
    return {"total_num_frames": t, "fps": fps, "frames_indices": list(range(t))}


# name: (text, video shapes (t, h, w), fps, image shapes (h, w), resize)
CASES = {
    "odd_5_frames_no_resize": ("Watch: ]<]video[>[ now", [(5, 56, 84)], 3.0, [], False),
    "even_20_frames_three_rows": ("]<]video[>[What happens?", [(20, 56, 56)], 30.0, [], False),
    "one_frame_fewer_than_min_frames": ("a ]<]video[>[ b", [(1, 56, 56)], 24.0, [], False),
    "odd_19_frames_resized_rows": ("x]<]video[>[", [(19, 40, 60)], 7.5, [], True),
    "video_and_image": ("see ]<]image[>[ and ]<]video[>[ then", [(9, 84, 56)], 2.0, [(70, 90)], False),
    "two_videos_no_fps": ("]<]video[>[ vs ]<]video[>[", [(3, 56, 56), (6, 84, 84)], None, [], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processor_equals_transformers(hf_processor, tokenizer, name):
    text, shapes, fps, image_shapes, resize = CASES[name]
    videos = [_frames(*s, seed=i) for i, s in enumerate(shapes)]
    images = [
        np.random.default_rng(9 + i).integers(0, 256, (*s, 3), dtype=np.uint8) for i, s in enumerate(image_shapes)
    ]
    kwargs = {"videos_kwargs": {"do_resize": True}} if resize else {}
    ref = hf_processor(
        text=[text],
        videos=videos,
        images=images or None,
        video_metadata=[_metadata(len(v), fps) for v in videos],
        **kwargs,
    )
    ours = mm.Processor(tokenizer)(text=text, images=images, videos=videos, video_fps=fps)
    np.testing.assert_array_equal(ours.video_grid_thw, _np(ref["video_grid_thw"]))
    assert ours.pixel_values_videos.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values_videos, _np(ref["pixel_values_videos"]))
    if images:
        np.testing.assert_array_equal(ours.pixel_values, _np(ref["pixel_values"]))
    assert ours.input_ids == [int(i) for i in ref["input_ids"][0]]
    # not vacuous: one timestamp per temporal patch when fps is known, rows of <= 4 temporal patches
    decoded = tokenizer.decode(ours.input_ids, skip_special_tokens=False)
    patches = sum(v.num_temporal_patches for v in ours.videos)
    assert decoded.count(" seconds[>[") == (patches if fps else 0)
    assert all(t <= 4 for t in ours.video_grid_thw[:, 0])
    assert ours.input_ids.count(512) == sum(v.num_tokens for v in ours.videos)


@pytest.mark.parametrize(("frames", "size", "num_frames", "fps"), [(30, 10.0, None, 2.0), (9, 3.0, None, 1.0)])
def test_frame_sampling_equals_transformers(hf_classes, frames, size, num_frames, fps):
    """``do_sample_frames``: the kept frames, their pixels and their timestamps (``frames_indices / source fps``)."""
    _, _, video_cls = hf_classes
    video = _frames(frames, 56, 56, seed=3)
    ref = video_cls()(
        video,
        do_sample_frames=True,
        fps=fps,
        num_frames=num_frames,
        return_metadata=True,
        video_metadata=[{"total_num_frames": frames, "fps": size}],
    )
    ours = mm.VideoProcessor(do_sample_frames=True, fps=fps or 1.0, num_frames=num_frames)(video, fps=size)
    np.testing.assert_array_equal(ours.frames_indices, ref["video_metadata"][0].frames_indices)
    np.testing.assert_array_equal(ours.pixel_values, _np(ref["pixel_values_videos"]))
    np.testing.assert_array_equal(ours.grid_thw, _np(ref["video_grid_thw"]))
    assert ours.timestamps == [
        ours.frames_indices[min(2 * p, len(ours.frames_indices) - 1)] / size for p in range(ours.num_temporal_patches)
    ]


def test_num_frames_sampling_equals_transformers_indices():
    """``num_frames``: transformers' processor cannot take it (its default fps 1.0 with num_frames is refused as
    mutually exclusive, and fps=None fails its kwargs validation); its index rule is compared directly."""
    pytest.importorskip("transformers")
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    for total, n in ((9, 4), (10, 10), (100, 7)):
        ref = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=5.0), num_frames=n)
        np.testing.assert_array_equal(mm.sample_frame_indices(total, 5.0, None, n), ref)
    batch = mm.VideoProcessor(do_sample_frames=True, num_frames=3)(_frames(9, 56, 56), fps=3.0)
    assert batch.frames_indices.tolist() == [0, 3, 6] and batch.timestamps == [0.0, 2.0]


def test_video_processor_defaults_and_resize_equal_transformers(hf_classes):
    """The video processor alone resizes (its default): a large frame is downscaled under max_pixels 768*28*28."""
    _, _, video_cls = hf_classes
    ref_proc = video_cls()
    ours = mm.VideoProcessor()
    for name in (
        "min_pixels",
        "max_pixels",
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "fps",
        "vision_segment_max_frames",
        "min_frames",
        "max_frames",
        "total_pixels",
        "do_sample_frames",
    ):
        assert getattr(ours, name) == getattr(ref_proc, name), name
    video = _frames(3, 700, 1000, seed=4)
    ref = ref_proc(video)
    batch = ours(video)
    np.testing.assert_array_equal(batch.grid_thw, _np(ref["video_grid_thw"]))
    np.testing.assert_array_equal(batch.pixel_values, _np(ref["pixel_values_videos"]))
    assert ours.num_video_tokens(3, 700, 1000) == batch.num_tokens
    segment = mm.VideoProcessor(vision_segment_max_frames=None)(_frames(12, 56, 56))
    assert segment.grid_thw.tolist() == [[6, 4, 4]]


def test_from_pretrained_reads_the_video_config(tmp_path, tokenizer):
    import json

    assert mm.VideoProcessor.from_pretrained(tmp_path) == mm.VideoProcessor()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 9999, "size": [672, 672]}))
    assert mm.VideoProcessor.from_pretrained(tmp_path).max_pixels == 9999  # transformers' fallback file
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"max_pixels": 50000, "vision_segment_max_frames": 2, "video_processor_type": "x"})
    )
    vproc = mm.VideoProcessor.from_pretrained(tmp_path)
    assert (vproc.max_pixels, vproc.vision_segment_max_frames) == (50000, 2)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"min_pixels": 1000}}))
    assert mm.VideoProcessor.from_pretrained(tmp_path).min_pixels == 1000
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    proc = mm.Processor.from_pretrained(tmp_path)
    assert (proc.video_token_id, proc.vision_start_token_id) == (512, 510)
    assert proc.video_processor.min_pixels == 1000


def test_processor_errors(tokenizer):
    proc = mm.Processor(tokenizer)
    video = _frames(2, 56, 56)
    with pytest.raises(ValueError, match="1 ]<]video"):
        proc(text="]<]video[>[", videos=[])
    with pytest.raises(ValueError, match="0 ]<]video"):
        proc(text="none", videos=[video])
    with pytest.raises(ValueError, match="video_fps has 2"):
        proc(text="]<]video[>[", videos=[video], video_fps=[1.0, 2.0])
    with pytest.raises(ValueError, match="share one size"):
        mm.VideoProcessor()([video[0], _frames(1, 84, 56)[0]])
    with pytest.raises(ValueError, match="no frames"):
        mm.VideoProcessor()([])
    with pytest.raises(ValueError, match="fps"):
        mm.VideoProcessor()(video, fps=0)
    with pytest.raises(ValueError, match="exceeds|sampling 9 frames"):
        mm.VideoProcessor(do_sample_frames=True, num_frames=9)(video)


# ---------------------------------------------------------------------- features and logits against transformers

# video grids as the video processor writes them: rows of <= 4 temporal patches, positions restarting per row
VIDEO_GRIDS = {
    "odd_3_patches_one_row": np.array([[3, 4, 4]]),
    "5_patches_two_rows": np.array([[4, 4, 6], [1, 4, 6]]),
    "9_patches_three_rows": np.array([[4, 2, 4], [4, 2, 4], [1, 2, 4]]),
}


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.fixture(scope="module")
def vl_pair(tmp_path_factory):
    """transformers' tiny random VL model (CPU, float32, eager) and ours loaded from the checkpoint it wrote."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from support.vl_reference import reference_vl_model, vl_config

    from jax_sparse_kv.nn import MiniMaxM3

    config = vl_config()
    ref = reference_vl_model(config, seed=5)
    assert ref.config.video_token_id == config.vision.video_token_id == 253
    path = str(tmp_path_factory.mktemp("vl_video") / "ckpt")
    ref.save_pretrained(path)
    ours = MiniMaxM3.from_pretrained(path)
    assert ours.config.vision.video_token_id == 253
    return torch, ref, ours


def prompt_with_video(config, grid_thw: np.ndarray, before: list[int], after: list[int]) -> list[int]:
    """``before``, then per temporal patch a 2-token stand-in for its timestamp text, start, the video
    placeholders (h * w / 4), end; then ``after`` (what `mm.Processor` writes, on ids)."""
    v = config.vision
    t, (h, w) = int(grid_thw[:, 0].sum()), grid_thw[0, 1:]
    ids = list(before)
    for p in range(t):
        ids += [40 + p, 60] + [v.image_start_token_id] + [v.video_token_id] * int(h * w // 4) + [v.image_end_token_id]
    return ids + list(after)


@pytest.mark.parametrize("grid", list(VIDEO_GRIDS))
def test_video_features_match_transformers(vl_pair, grid):
    from support.vl_reference import random_pixels

    torch, ref, ours = vl_pair
    grid_thw = VIDEO_GRIDS[grid]
    pixels = random_pixels(grid_thw, seed=7)
    with torch.no_grad():
        theirs = ref.model.get_video_features(torch.tensor(pixels), torch.tensor(grid_thw)).pooler_output
    mine = ours.embed_images(pixels, grid_thw)
    assert [tuple(m.shape) for m in mine] == [tuple(t.shape) for t in theirs]
    errors = [_rel(m, t.numpy()) for m, t in zip(mine, theirs, strict=True)]
    assert max(errors) < 1e-4, errors
    # not vacuous: one segment over all rows (no temporal restart) is far from transformers
    whole = np.array([[int(grid_thw[:, 0].sum()), *grid_thw[0, 1:]]])
    if len(grid_thw) > 1:
        assert _rel(np.concatenate(ours.embed_images(pixels, whole)), torch.cat(theirs).numpy()) > 1e-3


@pytest.mark.parametrize("grid", ["5_patches_two_rows"])
def test_prefill_logits_with_a_video_match_transformers(vl_pair, grid):
    import jax.numpy as jnp
    from support.common import model_call
    from support.vl_reference import random_pixels

    torch, ref, ours = vl_pair
    config = ours.config
    grid_thw = VIDEO_GRIDS[grid]
    pixels = random_pixels(grid_thw, seed=8)
    ids = prompt_with_video(config, grid_thw, [5, 6, 7], [9, 10, 11])
    with torch.no_grad():
        theirs = ref(
            input_ids=torch.tensor([ids]),
            pixel_values_videos=torch.tensor(pixels),
            video_grid_thw=torch.tensor(grid_thw),
        ).logits.numpy()
    features = jnp.concatenate(ours.embed_images(pixels, grid_thw))
    is_video = np.asarray(ids) == config.vision.video_token_id
    index = np.where(is_video, np.cumsum(is_video) - 1, -1).astype(np.int32)[None]
    logits, _ = model_call(
        ours, jnp.asarray([ids]), jnp.arange(len(ids))[None], image_features=features, image_index=jnp.asarray(index)
    )
    assert _rel(logits, theirs) < 1e-4
