"""Image placeholder expansion against transformers' ``MiniMaxM3VLProcessor`` (transformers 5.25).

transformers' processor expands each ``]<]image[>[`` in the *text* into ``]<]start of image[>[`` + ``]<]image[>[`` *
``t * h * w // merge**2`` + ``]<]end of image[>[`` and then tokenizes; ours tokenizes the prompt first and expands
the ids (`jax_sparse_kv.multimodal.expand_image_tokens`). Both are run here on the same text and images (uint8
arrays, some resized) and must give the same ``input_ids``, ``image_grid_thw`` and ``pixel_values`` (bit for bit).

The reference is transformers' real processor: its image processor runs through tests/support/torchvision_shim.py (as in
tests/test_image_processor.py); its tokenizer is the demo tokenizer (509 ids) with the three image tokens added as
ids 509-511, wrapped in a ``PreTrainedTokenizerFast``. transformers' constructor refuses ``video_processor=None``
(``TypeError``: a ``VideoProcessorMixin`` is expected), so it gets the real ``MiniMaxM3VLVideoProcessor``, which
constructs under the shim as it is (it only needs ``InterpolationMode``); no video is processed.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from jax_sparse_kv.multimodal import ImageProcessor, expand_image_tokens

IMAGE = "]<]image[>["
IMAGE_START = "]<]start of image[>["
IMAGE_END = "]<]end of image[>["
IMAGE_ID, IMAGE_START_ID, IMAGE_END_ID = 509, 510, 511


def _image(height: int, width: int, seed: int, channels: int = 3) -> np.ndarray:
    shape = (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def tokenizer():
    """The demo tokenizer (ids 0-508) with the image markers added as special tokens 509, 510, 511."""
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    tok = TextTokenizer.demo(509).tokenizer
    assert tok.add_special_tokens([IMAGE, IMAGE_START, IMAGE_END]) == 3
    assert [tok.token_to_id(t) for t in (IMAGE, IMAGE_START, IMAGE_END)] == [IMAGE_ID, IMAGE_START_ID, IMAGE_END_ID]
    # no post-processor: neither side adds BOS/EOS (transformers' add_special_tokens=True is a no-op here)
    assert tok.post_processor is None
    return tok


@pytest.fixture(scope="module")
def config():
    from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config

    vision = tiny_vision_config(
        image_token_id=IMAGE_ID, image_start_token_id=IMAGE_START_ID, image_end_token_id=IMAGE_END_ID
    )
    return tiny_config(vocab_size=512, vision=vision)


@pytest.fixture(scope="module")
def processor(tokenizer):
    """transformers' ``MiniMaxM3VLProcessor``, usable while this module's tests run (the shim stays installed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import transformers
    from support import torchvision_shim  # tests/ is on sys.path: tests/support/ is a package there
    from transformers import PreTrainedTokenizerFast

    with torchvision_shim.installed(), pytest.MonkeyPatch.context() as patch:
        from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
        from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
        from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

        # when another test imported transformers before the shim, its top-level lazy module hands out dummies for
        # torchvision-backed names (the processor looks its classes up there): give it the real ones for now
        from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin

        for cls in (MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor, VideoProcessorMixin, BaseVideoProcessor):
            patch.setattr(transformers, cls.__name__, cls, raising=False)
        video_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
        patch.setattr(transformers, "VIDEO_PROCESSOR_MAPPING", video_auto.VIDEO_PROCESSOR_MAPPING, raising=False)

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        image_processor = MiniMaxM3VLImageProcessor()
        with pytest.raises(TypeError, match="video_processor"):  # None is refused: see the module docstring
            MiniMaxM3VLProcessor(image_processor=image_processor, tokenizer=fast, video_processor=None)
        hf = MiniMaxM3VLProcessor(
            image_processor=image_processor, tokenizer=fast, video_processor=MiniMaxM3VLVideoProcessor()
        )
        assert (hf.image_token_id, hf.vision_start_token_id, hf.vision_end_token_id) == (
            IMAGE_ID,
            IMAGE_START_ID,
            IMAGE_END_ID,
        )
        assert hf.image_processor.merge_size == 2
        yield hf


def _numpy(x) -> np.ndarray:
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _ours(tokenizer, config, texts: list[str], images: list[np.ndarray]):
    """Our expansion of each prompt (its images' grid_thw rows, in order), and our image batch of all the images."""
    batch = ImageProcessor()(images)
    ids, row = [], 0
    for text in texts:
        n = text.count(IMAGE)
        ids.append(expand_image_tokens(tokenizer.encode(text).ids, batch.grid_thw[row : row + n], config))
        row += n
    assert row == len(images)
    return ids, batch


def _assert_same(processor, tokenizer, config, texts: list[str], images: list[np.ndarray]) -> None:
    out = processor(text=texts, images=images)
    ids, batch = _ours(tokenizer, config, texts, images)
    grid_thw = _numpy(out["image_grid_thw"])
    pixel_values = _numpy(out["pixel_values"])
    np.testing.assert_array_equal(batch.grid_thw, grid_thw)
    assert batch.pixel_values.shape == pixel_values.shape and batch.pixel_values.dtype == pixel_values.dtype
    np.testing.assert_array_equal(batch.pixel_values, pixel_values)
    assert [list(map(int, x)) for x in out["input_ids"]] == ids
    # not vacuous: every image became start + t*h*w/4 placeholders + end
    merged = [int(n) // 4 for n in grid_thw.prod(axis=1)]
    assert sum(x.count(IMAGE_ID) for x in ids) == sum(merged)
    assert sum(x.count(IMAGE_START_ID) for x in ids) == sum(x.count(IMAGE_END_ID) for x in ids) == len(images)


CASES = {
    # name: (text, image shapes (height, width, channels))
    "one_image_no_resize": ("Describe ]<]image[>[ please.", [(56, 56, 3)]),
    "one_image_resized_at_start": ("]<]image[>[ What is in it?", [(300, 200, 3)]),
    "one_image_downscaled_over_max_pixels": ("Look: ]<]image[>[", [(900, 700, 3)]),
    "two_images_with_text_between": ("first ]<]image[>[ then ]<]image[>[ end", [(70, 90, 3), (300, 200, 3)]),
    "two_images_back_to_back": ("compare]<]image[>[]<]image[>[and say", [(56, 56, 3), (70, 90, 3)]),
    "two_images_back_to_back_only": ("]<]image[>[]<]image[>[", [(300, 200, 3), (56, 84, 3)]),
    "chat_prompt_grayscale": (
        "<|im_start|>user\n]<]image[>[\nWhat is this?<|im_end|>\n<|im_start|>assistant\n<think>",
        [(100, 120, 1)],  # [H, W] alone is refused by transformers (not a flat list of images), [H, W, 1] is not
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expansion_equals_transformers(processor, tokenizer, config, name):
    text, shapes = CASES[name]
    images = [_image(h, w, seed, c) for seed, (h, w, c) in enumerate(shapes)]
    _assert_same(processor, tokenizer, config, [text], images)


def test_batch_of_prompts_equals_transformers(processor, tokenizer, config):
    """Two prompts, images flat across them in order (transformers' layout): each prompt expands its own rows."""
    texts = ["a ]<]image[>[ b", "]<]image[>[]<]image[>[ c"]
    images = [_image(70, 90, 0), _image(56, 56, 1), _image(300, 200, 2)]
    _assert_same(processor, tokenizer, config, texts, images)


def test_text_without_images_equals_transformers(processor, tokenizer, config):
    text = "<|im_start|>user\nno image here<|im_end|>\n"
    out = processor(text=[text])
    assert [list(map(int, x)) for x in out["input_ids"]] == [
        expand_image_tokens(tokenizer.encode(text).ids, [], config)
    ]
    assert "pixel_values" not in out


@pytest.mark.parametrize(
    ("text", "n_images"),
    [("a ]<]image[>[ b ]<]image[>[", 1), ("one ]<]image[>[", 2), ("no images ]<]image[>[", 0)],
    ids=["two_markers_one_image", "one_marker_two_images", "one_marker_no_image"],
)
def test_marker_count_mismatch_raises_like_transformers(processor, tokenizer, config, text, n_images):
    """Markers != images: ours raises ValueError; so does transformers (``validate_inputs``, before any processing:
    "The total number of ]<]image[>[ tokens in the prompts should be the same as the number of images passed", or
    "Found 1 ]<]image[>[ tokens in the text but no images were passed")."""
    images = [_image(56, 56, seed) for seed in range(n_images)]
    grid_thw = ImageProcessor()(images).grid_thw if images else np.zeros((0, 3), np.int64)
    with pytest.raises(ValueError, match="image placeholders"):
        expand_image_tokens(tokenizer.encode(text).ids, grid_thw, config)
    with pytest.raises(ValueError, match=r"\]<\]image\[>\[ tokens"):
        processor(text=[text], images=images or None)
