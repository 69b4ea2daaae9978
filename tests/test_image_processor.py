"""jax_sparse_kv.multimodal: the image processor against transformers' ``MiniMaxM3VLImageProcessor``, and media.py.

The reference is transformers' real class (5.25), run with tests/support/torchvision_shim.py standing in for torchvision
(not installable here next to the CPU torch): the shim's resize is ``F.interpolate`` on the uint8 tensor, which is
what torchvision runs on the CPU. Because our resize is a port of that uint8 kernel, ``pixel_values`` are compared
exactly (within 1e-6) for resized images too; Pillow's bicubic, which the port replaces, is measured against it.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from jax_sparse_kv.multimodal import (
    CLIP_STD,
    ImageBatch,
    ImageProcessor,
    decode_data_url,
    load_image,
    resize_bicubic_aa,
    smart_resize,
)

Image = pytest.importorskip("PIL.Image")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ATOL = 1e-6


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _image(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width) if channels == 0 else (height, width, channels)
    return _rng(seed).integers(0, 256, shape, dtype=np.uint8)


# ------------------------------------------------------------------------------------------ the reference


@pytest.fixture(scope="module")
def hf():
    """transformers' image processing module, importable through the torchvision shim while this module runs."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support import torchvision_shim  # tests/ is on sys.path: tests/support/ is a package there

    with torchvision_shim.installed():
        # import_module, not `from transformers.models.minimax_m3_vl import ...`: once another test has imported
        # transformers' VL package without torchvision, its lazy module hands out a dummy for this submodule
        module = importlib.import_module("transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl")
        yield module


def _reference(hf, images, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    out = hf.MiniMaxM3VLImageProcessor(**kwargs)(images, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def _assert_matches(hf, images, **kwargs) -> ImageBatch:
    """Ours and transformers' with the same settings: grid_thw equal, pixel_values within 1e-6 (measured: equal)."""
    batch = ImageProcessor(**kwargs)(images)
    pixel_values, grid_thw = _reference(hf, images, **kwargs)
    assert batch.pixel_values.dtype == np.float32 and batch.grid_thw.dtype == np.int64
    np.testing.assert_array_equal(batch.grid_thw, grid_thw)
    assert batch.pixel_values.shape == pixel_values.shape
    np.testing.assert_allclose(batch.pixel_values, pixel_values, rtol=0, atol=ATOL)
    return batch


# ------------------------------------------------------------------------------------------ smart_resize

SIZES = [
    1,
    2,
    10,
    13,
    14,
    27,
    28,
    29,
    41,
    42,
    55,
    56,
    57,
    99,
    100,
    223,
    224,
    337,
    500,
    640,
    671,
    672,
    673,
    1000,
    1080,
    1920,
    2000,
    3024,
    4032,
    5599,
]


def test_smart_resize_equals_transformers(hf):
    limits = [(3136, 451584), (3136, 1003520), (100 * 784, 200 * 784), (784, 784)]
    branches = {"max": 0, "min": 0, "none": 0}
    for min_pixels, max_pixels in limits:
        for height in SIZES:
            for width in SIZES:
                if max(height, width) / min(height, width) > 200:
                    continue
                expected = hf.smart_resize(height, width, 28, min_pixels, max_pixels)
                assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected, (height, width)
                rounded = round(height / 28) * 28 * round(width / 28) * 28
                branches["max" if rounded > max_pixels else "min" if rounded < min_pixels else "none"] += 1
    assert all(count > 20 for count in branches.values()), branches  # every branch of the arithmetic ran
    for factor in (14, 32):
        assert smart_resize(333, 777, factor, 1000, 90000) == hf.smart_resize(333, 777, factor, 1000, 90000)


def test_smart_resize_aspect_ratio_error_as_transformers(hf):
    for height, width in [(1, 201), (1000, 4), (5, 1001)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            hf.smart_resize(height, width)
        with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
            smart_resize(height, width)
    assert smart_resize(1, 200) == hf.smart_resize(1, 200, max_pixels=451584)


def test_smart_resize_known_values():
    assert smart_resize(1000, 1000) == (672, 672)  # the max branch: area 451584 at most
    assert smart_resize(10, 10) == (56, 56)  # the min branch: area 3136 at least
    assert smart_resize(56, 84) == (56, 84)
    assert smart_resize(100, 150) == (112, 140)  # round(100/28)=4, round(150/28)=5
    for bad in [(0, 10), (10, -1)]:
        with pytest.raises(ValueError, match="must be positive"):
            smart_resize(*bad)
    with pytest.raises(TypeError, match="height must be an int"):
        smart_resize(10.5, 10)


# ------------------------------------------------------------------------------------------ pixel values


@pytest.mark.parametrize("size", [(56, 84), (28 * 2, 28 * 2), (28 * 4, 28 * 6), (28 * 10, 28 * 3), (672, 672)])
def test_no_resize_equals_transformers(hf, size):
    assert smart_resize(*size) == size  # no resize on this path
    batch = _assert_matches(hf, _image(*size, seed=size[0] + size[1]))
    assert batch.grid_thw.tolist() == [[1, size[0] // 14, size[1] // 14]]
    assert batch.pixel_values.shape == (size[0] * size[1] // 196, 1176)


@pytest.mark.parametrize(
    "size",
    [(100, 150), (1000, 1000), (37, 53), (20, 30), (57, 3000), (3000, 57), (719, 1283), (2, 2), (6, 1000)],
)
def test_resized_images_equal_transformers(hf, size):
    assert smart_resize(*size) != size  # these do get resized
    _assert_matches(hf, _image(*size, seed=size[0] * 7 + size[1]))


def test_batch_of_images_concatenated_in_order(hf):
    images = [_image(100, 120, seed=1), _image(56, 84, seed=2), _image(100, 120, seed=3), _image(300, 200, seed=4)]
    batch = _assert_matches(hf, images)
    singles = [ImageProcessor()(image) for image in images]
    np.testing.assert_array_equal(batch.pixel_values, np.concatenate([s.pixel_values for s in singles]))
    np.testing.assert_array_equal(batch.grid_thw, np.concatenate([s.grid_thw for s in singles]))
    assert batch.num_tokens == [s.num_tokens[0] for s in singles]
    assert sum(t * h * w for t, h, w in batch.grid_thw) == batch.pixel_values.shape[0]


def test_rgb_conversions_equal_transformers(hf):
    rgba = _image(90, 130, 4, seed=5)
    rgba[:10, :, 3] = 0  # fully transparent and opaque rows besides random alpha
    rgba[10:20, :, 3] = 255
    _assert_matches(hf, rgba)  # torchvision's float32 blend onto white
    _assert_matches(hf, _image(100, 120, 1, seed=6))
    _assert_matches(hf, Image.fromarray(rgba, "RGBA"))  # Pillow's alpha_composite onto white
    _assert_matches(hf, Image.fromarray(_image(90, 130, 0, seed=7), "L"))
    palette = Image.fromarray(_image(90, 130, seed=8)).convert("P")
    palette.info["transparency"] = 5
    _assert_matches(hf, palette)
    _assert_matches(hf, Image.fromarray(_image(90, 130, seed=9)).convert("CMYK"))
    _assert_matches(hf, [Image.fromarray(_image(64, 64, seed=10)), _image(200, 90, seed=11)])
    _assert_matches(hf, Image.fromarray(_image(1, 1, seed=16)))  # (a 1x1x3 array would be channels-first there)
    # an [H, W] array, which transformers takes only as [H, W, 1]
    gray = _image(100, 120, 0, seed=12)
    np.testing.assert_array_equal(ImageProcessor()(gray).pixel_values, ImageProcessor()(gray[:, :, None]).pixel_values)
    pixel_values, _ = _reference(hf, gray[:, :, None])
    np.testing.assert_allclose(ImageProcessor()(gray).pixel_values, pixel_values, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_rescale": False},
        {"do_normalize": False},
        {"do_rescale": False, "do_normalize": False},
        {"min_pixels": 100 * 784, "max_pixels": 200 * 784},
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.25, 0.125]},
        {"rescale_factor": 1 / 127.5},
    ],
)
def test_options_equal_transformers(hf, kwargs):
    _assert_matches(hf, [_image(100, 150, seed=13), _image(56, 56, seed=14)], **kwargs)


def test_do_resize_false_equals_transformers(hf):
    _assert_matches(hf, _image(56 * 3, 28 * 5, seed=15), do_resize=False)
    with pytest.raises(ValueError, match="multiples of 28"):
        ImageProcessor(do_resize=False)(_image(100, 150))


def test_num_image_tokens_equal_transformers(hf):
    reference = hf.MiniMaxM3VLImageProcessor()
    processor = ImageProcessor()
    for height in SIZES[::3]:
        for width in SIZES[::4]:
            if max(height, width) / min(height, width) > 200:
                continue
            patches = reference.get_number_of_image_patches(height, width)
            t, h, w = processor.grid(height, width)
            assert t * h * w == patches
            assert processor.num_image_tokens(height, width) == patches // 4
    batch = processor([_image(1000, 1000), _image(56, 84)])
    assert batch.num_tokens == [576, 6] == [processor.num_image_tokens(1000, 1000), processor.num_image_tokens(56, 84)]


# ------------------------------------------------------------------------------------------ the resize


def test_resize_is_bit_exact_to_torch_uint8_kernel():
    torch = pytest.importorskip("torch")
    rng = _rng(20)
    cases = [(3000, 57, 448, 28), (1, 1, 56, 56), (13, 1000, 28, 2100), (5, 7, 5, 700)]
    cases += [tuple(int(v) for v in rng.integers(1, 400, 4)) for _ in range(30)]
    for height, width, new_height, new_width in cases:
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        tensor = torch.from_numpy(image).permute(2, 0, 1).contiguous()[None]
        expected = (
            torch.nn.functional.interpolate(
                tensor, size=[new_height, new_width], mode="bicubic", align_corners=False, antialias=True
            )[0]
            .permute(1, 2, 0)
            .numpy()
        )
        got = resize_bicubic_aa(image, new_height, new_width)
        assert got.dtype == np.uint8 and got.shape == (new_height, new_width, 3)
        np.testing.assert_array_equal(got, expected, err_msg=f"{(height, width)} -> {(new_height, new_width)}")


def _photo(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth image with mild noise, closer to a photo than uniform noise is."""
    rng = _rng(seed)
    y, x = np.linspace(0, 1, height)[:, None, None], np.linspace(0, 1, width)[None, :, None]
    phase = rng.uniform(0, 6, (1, 1, 3))
    noise = rng.normal(0, 4, (height, width, 3))
    values = 128 + 60 * np.sin(6 * x + phase) * np.cos(4 * y + phase) + 40 * (x - y) + noise
    return np.clip(values, 0, 255).astype(np.uint8)


def test_pillow_bicubic_is_close_to_the_resize_but_not_equal():
    """Why the resize is a port and not Pillow. Pillow's bicubic is the same filter with 22-bit weights (torch's
    are int16 of dynamic precision), and Pillow 13 runs the height pass first for some sizes (torch always
    starts with the width). Measured on photo-like images (150 random sizes): max 2 levels, mean 0.004 where the
    pass order agrees, up to 0.27 where it does not; i.e. up to 2/255/min(std) = 0.030 in pixel_values. On uniform
    noise with a slight resize the pass order alone moves values by up to 26 levels (overshoots clipped to uint8
    between the passes at different places)."""
    differing, total = 0, 0
    for height, width in [(1000, 1000), (100, 150), (37, 53), (320, 58), (1015, 282), (3000, 57)]:
        image = _photo(height, width, seed=height + width)
        new_height, new_width = smart_resize(height, width)
        ours = resize_bicubic_aa(image, new_height, new_width).astype(int)
        pillow = Image.fromarray(image).resize((new_width, new_height), Image.Resampling.BICUBIC)
        diff = np.abs(ours - np.asarray(pillow).astype(int))
        assert diff.max() <= 2, (height, width)
        assert diff.mean() < 0.3, (height, width)
        differing += int((diff > 0).sum())
        total += diff.size
    assert 0 < differing / total < 0.1  # close, but not the same kernel
    assert 2 / 255 / min(CLIP_STD) < 0.0301


def test_resize_keeps_a_side_of_unchanged_size_untouched():
    image = _image(56, 90, seed=22)
    np.testing.assert_array_equal(resize_bicubic_aa(image, 56, 90), image)
    np.testing.assert_array_equal(resize_bicubic_aa(image, 56, 60)[:, :, 0].shape, (56, 60))
    constant = np.full((70, 90, 3), 77, np.uint8)  # a constant image stays constant (weights sum to one)
    assert (resize_bicubic_aa(constant, 33, 150) == 77).all()
    with pytest.raises(ValueError, match="uint8"):
        resize_bicubic_aa(image.astype(np.float32), 10, 10)


# ------------------------------------------------------------------------------------------ patch order


def test_patch_order_of_a_coordinate_image():
    """Checked without transformers: R = row, G = column, B = 7; each pixel must land where the layout says."""
    height, width = 56, 84
    image = np.empty((height, width, 3), np.uint8)
    image[..., 0] = np.arange(height)[:, None]
    image[..., 1] = np.arange(width)[None, :]
    image[..., 2] = 7
    batch = ImageProcessor(do_rescale=False, do_normalize=False)(image)
    assert batch.grid_thw.tolist() == [[1, 4, 6]]
    values = batch.pixel_values.reshape(24, 3, 2, 14, 14)  # (patch, channel, time, row, col)
    row = 0
    for block_row in range(2):
        for block_col in range(3):
            for i in range(2):
                for j in range(2):
                    patch_row, patch_col = 2 * block_row + i, 2 * block_col + j
                    for t in range(2):
                        patch = values[row, :, t]
                        rows = np.broadcast_to(np.arange(14)[:, None] + 14 * patch_row, (14, 14))
                        cols = np.broadcast_to(np.arange(14)[None, :] + 14 * patch_col, (14, 14))
                        np.testing.assert_array_equal(patch[0], rows)
                        np.testing.assert_array_equal(patch[1], cols)
                        assert (patch[2] == 7).all()
                    row += 1
    assert row == batch.pixel_values.shape[0]


def test_normalization_values():
    image = np.zeros((56, 56, 3), np.uint8)
    image[:, 28:] = 255
    values = ImageProcessor()(image).pixel_values.reshape(16, 3, 2, 14, 14)
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array(CLIP_STD)
    # 2x2 merge blocks of 28x28, block-major: blocks 0 and 2 (patches 0-3, 8-11) are the black left half
    for patch in range(16):
        value = 0.0 if patch // 4 in (0, 2) else 1.0
        expected = np.broadcast_to(((value - mean) / std)[:, None, None, None], (3, 2, 14, 14))
        np.testing.assert_allclose(values[patch], expected, rtol=1e-6)


# ------------------------------------------------------------------------------------------ configuration


def test_defaults_are_transformers(hf):
    assert _as_dict(ImageProcessor()) == _as_dict(hf.MiniMaxM3VLImageProcessor())
    assert ImageProcessor().patch_dim == 1176 and ImageProcessor().factor == 28


CONFIGS = [
    {},
    {"size": [672, 672], "patch_size": 14},
    {"size": {"shortest_edge": 12544, "longest_edge": 1003520}, "image_processor_type": "MiniMaxM3VLImageProcessor"},
    {"size": {"shortest_edge": 3136, "longest_edge": 451584}, "min_pixels": 6272, "max_pixels": 200704},
    {"min_pixels": 6272},
    {
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": False,
        "processor_class": "X",
        "resample": 3,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "rescale_factor": 0.00392156862745098,
    },
]


FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "do_resize", "do_rescale")
FIELDS += ("do_normalize", "do_convert_rgb")


def _as_dict(processor) -> dict:
    """The settings of ours or of transformers' processor, in our names."""
    out = {name: getattr(processor, name) for name in FIELDS}
    out["image_mean"], out["image_std"] = tuple(processor.image_mean), tuple(processor.image_std)
    if isinstance(processor, ImageProcessor):
        out["min_pixels"], out["max_pixels"] = processor.min_pixels, processor.max_pixels
    else:
        out["min_pixels"], out["max_pixels"] = processor.size.shortest_edge, processor.size.longest_edge
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_from_pretrained_reads_what_transformers_reads(hf, tmp_path, config):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ours = ImageProcessor.from_pretrained(tmp_path)
    assert ours == ImageProcessor.from_dict(config)
    assert _as_dict(ours) == _as_dict(hf.MiniMaxM3VLImageProcessor.from_pretrained(str(tmp_path)))


def test_from_dict_keys():
    assert ImageProcessor.from_dict({}) == ImageProcessor()
    assert ImageProcessor.from_dict({"size": [672, 672]}) == ImageProcessor()
    custom = ImageProcessor.from_dict({"size": {"shortest_edge": 1000, "longest_edge": 20000}, "unknown": [1]})
    assert (custom.min_pixels, custom.max_pixels) == (1000, 20000)
    top = ImageProcessor.from_dict({"size": {"shortest_edge": 1000, "longest_edge": 20000}, "max_pixels": 30000})
    assert (top.min_pixels, top.max_pixels) == (1000, 30000)
    aliases = ImageProcessor.from_dict({"size": {"min_pixels": 2000, "max_pixels": 40000}})
    assert (aliases.min_pixels, aliases.max_pixels) == (2000, 40000)
    nulls = ImageProcessor.from_dict({"image_mean": None, "do_resize": None, "patch_size": None})
    assert nulls == ImageProcessor()
    flags = ImageProcessor.from_dict({"do_rescale": False, "image_std": [1, 2, 3]})
    assert flags.do_rescale is False and flags.image_std == (1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="longest_edge"):
        ImageProcessor.from_dict({"size": {"shortest_edge": 1000}})
    with pytest.raises(ValueError, match="size must be a dict"):
        ImageProcessor.from_dict({"size": 448})
    with pytest.raises(ValueError, match="only bicubic"):
        ImageProcessor.from_dict({"resample": 2})
    with pytest.raises(ValueError, match="min_pixels .* more than max_pixels"):
        ImageProcessor.from_dict({"min_pixels": 10**6, "max_pixels": 10**5})
    with pytest.raises(ValueError, match="3 values"):
        ImageProcessor.from_dict({"image_mean": [0.5, 0.5]})
    with pytest.raises(TypeError, match="mapping"):
        ImageProcessor.from_dict([("size", None)])


def test_from_pretrained_files(tmp_path):
    assert ImageProcessor.from_pretrained(tmp_path) == ImageProcessor()  # no preprocessor_config.json
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 100352, "merge_size": 2}))
    assert ImageProcessor.from_pretrained(str(tmp_path)).max_pixels == 100352
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        ImageProcessor.from_pretrained(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ errors


def test_input_errors():
    processor = ImageProcessor()
    with pytest.raises(ValueError, match="the list is empty"):
        processor([])
    with pytest.raises(ValueError, match="must be uint8.*float32"):
        processor(_image(56, 56).astype(np.float32))
    with pytest.raises(ValueError, match=r"image 1: .*shape \(56, 56, 2\)"):
        processor([_image(56, 56), _image(56, 56, 2)])
    with pytest.raises(ValueError, match=r"shape \(1, 56, 56, 3\)"):
        processor(_image(56, 56)[None])
    with pytest.raises(TypeError, match="expected a PIL image, a numpy array or a list"):
        processor("photo.png")
    with pytest.raises(TypeError, match=r"image 1: expected a PIL.Image.Image or a numpy array, got .*str"):
        processor([_image(56, 56), "photo.png"])
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        processor(_image(2, 500))
    with pytest.raises(ValueError, match="empty"):
        processor(np.zeros((0, 10, 3), np.uint8))
    with pytest.raises(ValueError, match="do_convert_rgb=False takes only 3"):
        ImageProcessor(do_convert_rgb=False)(_image(56, 56, 4))
    with pytest.raises(ValueError, match="not 8-bit RGB"):
        ImageProcessor(do_convert_rgb=False)(Image.fromarray(_image(56, 56, 0), "L"))
    with pytest.raises(ValueError, match="must be positive"):
        ImageProcessor(patch_size=0)
    with pytest.raises(ValueError, match="image_std has a zero"):
        ImageProcessor(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="grid_thw accounts for 4 patches but pixel_values has 3"):
        ImageBatch(np.zeros((3, 1176), np.float32), np.array([[1, 2, 2]]))


def test_no_torch_and_no_pillow_on_the_array_path():
    code = (
        "import sys, numpy as np\n"
        "from jax_sparse_kv.multimodal import ImageProcessor\n"
        "batch = ImageProcessor()(np.zeros((300, 200, 3), np.uint8))\n"
        "assert batch.pixel_values.shape == (308, 1176), batch.pixel_values.shape  # 308 x 196 pixels\n"
        "print(sorted(m for m in ('torch', 'torchvision', 'PIL') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ media


def _encode(image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_decode_data_url():
    png = _encode(Image.fromarray(_image(20, 30)), "PNG")
    assert decode_data_url(_data_url(png)) == ("image/png", png)
    assert decode_data_url(_data_url(png, "IMAGE/JPEG"))[0] == "image/jpeg"
    wrapped = _data_url(png)
    wrapped = wrapped[:40] + "\n" + wrapped[40:80] + " \r\n" + wrapped[80:]
    assert decode_data_url(wrapped)[1] == png  # line breaks in the payload
    unpadded = _data_url(b"\x89PNG1").rstrip("=")
    assert decode_data_url(unpadded)[1] == b"\x89PNG1"
    assert decode_data_url("data:image/svg+xml;charset=utf-8,%3Csvg%3E")[1] == b"<svg>"  # percent-encoded


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "not a data URL"),
        ("data:image/png;base64", "no ','"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not an image type"),
        ("data:;base64,aGVsbG8=", "'text/plain' is not an image type"),
        ("data:image/png;base64,aGVs*bG8=", "invalid base64 payload"),
        ("data:image/png;base64,a", "invalid base64 payload"),
        ("data:image/png;base64,", "empty payload"),
    ],
)
def test_decode_data_url_errors(url, message):
    with pytest.raises(ValueError, match=message):
        decode_data_url(url)


def test_decode_data_url_type_error():
    with pytest.raises(TypeError, match="must be a string"):
        decode_data_url(b"data:image/png;base64,AAAA")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_load_image_formats(fmt):
    pixels = np.zeros((24, 40, 3), np.uint8)
    pixels[:, 20:] = (200, 30, 60)
    image = Image.fromarray(pixels)
    if fmt == "WEBP":
        data = _encode(image, fmt, lossless=True)
    elif fmt == "GIF":  # two frames: the first is read
        second = Image.fromarray(np.full_like(pixels, 255))
        data = _encode(image, fmt, save_all=True, append_images=[second], duration=100, loop=0)
    else:
        data = _encode(image, fmt)
    loaded = load_image(data)
    assert loaded.mode == "RGB" and loaded.size == (40, 24)
    array = np.asarray(loaded).astype(int)
    tolerance = 40 if fmt == "JPEG" else 3  # JPEG is lossy; GIF's palette holds these two colors exactly
    assert np.abs(array[:, :16] - 0).max() <= tolerance
    assert np.abs(array[:, 24:] - [200, 30, 60]).max() <= tolerance
    assert load_image(bytearray(data)).size == (40, 24) and load_image(memoryview(data)).size == (40, 24)


def test_load_image_transparency_onto_white_and_exif_orientation():
    rgba = np.zeros((10, 12, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, 6:, 3] = 255  # the left half fully transparent
    loaded = np.asarray(load_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG")))
    assert (loaded[:, :6] == 255).all()
    assert (loaded[:, 6:] == [200, 0, 0]).all()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    data = _encode(Image.fromarray(_image(20, 50)), "JPEG", exif=exif)
    assert Image.open(io.BytesIO(data)).size == (50, 20)
    assert load_image(data).size == (20, 50)


def test_load_image_errors():
    png = _encode(Image.fromarray(_image(64, 64)), "PNG")
    with pytest.raises(ValueError, match="cannot decode image"):
        load_image(png[: len(png) // 2])  # truncated: the header reads, the pixels do not
    with pytest.raises(ValueError, match="cannot decode image: not a PNG, JPEG, WEBP, GIF file"):
        load_image(b"this is not an image at all")
    with pytest.raises(ValueError, match="cannot decode image: not a PNG"):
        load_image(_encode(Image.fromarray(_image(8, 8)), "BMP"))  # a format that is not accepted
    with pytest.raises(ValueError, match="cannot decode image: no data"):
        load_image(b"")
    with pytest.raises(TypeError, match="must be bytes"):
        load_image("iVBORw0KGgo=")
    with pytest.raises(ValueError, match="max_image_pixels must be a positive int"):
        load_image(png, max_image_pixels=0)


def test_load_image_pixel_limit_before_decoding():
    png = _encode(Image.fromarray(_image(64, 64)), "PNG")
    assert load_image(png, max_image_pixels=64 * 64).size == (64, 64)
    with pytest.raises(ValueError, match=r"image too large: 64 x 64 = 4096 pixels, more than max_image_pixels=4095"):
        load_image(png, max_image_pixels=4095)
    # a truncated file over the limit: refused for its size, so before its pixels were decoded
    with pytest.raises(ValueError, match="image too large"):
        load_image(png[: len(png) // 2], max_image_pixels=1000)


@pytest.mark.parametrize("pixels", [40 * 40, 50 * 50])  # Pillow's warning range, then its error range
def test_pillow_decompression_bomb_is_a_value_error(monkeypatch, pixels):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    side = int(pixels**0.5)
    data = _encode(Image.fromarray(_image(side, side)), "PNG")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="image too large"):
            load_image(data)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
