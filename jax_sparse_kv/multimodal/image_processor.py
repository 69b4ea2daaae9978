"""The image processor of MiniMax-M3 VL in NumPy: images -> ``pixel_values`` and ``grid_thw``, without torch.

What transformers does (``MiniMaxM3VLImageProcessor``, a ``TorchvisionBackend``, transformers 5.25), per image:

1. convert to RGB: a PIL image with transparency is alpha-composited onto white with Pillow, other PIL modes go
   through ``convert("RGB")``; an array with one channel is repeated to three, an RGBA array is blended onto
   white in float32 (``rgb * a + (1 - a)``, ``a = alpha / 255``) and cast back to uint8 by truncation of
   ``x * 255.999`` (torchvision's ``to_dtype``);
2. resize to ``smart_resize(h, w)``: both sides multiples of ``patch_size * merge_size`` (28), the area within
   ``[min_pixels, max_pixels]`` (``size["shortest_edge"]``, ``size["longest_edge"]``; 3136 and 451584), the
   aspect ratio kept (more than 200:1 is a ``ValueError``); bicubic with antialiasing through torchvision on the
   uint8 tensor, which on the CPU is torch's native uint8 kernel (``_upsample_bicubic2d_aa``: Pillow's filter with
   a = -0.5, integer weights of dynamic precision, a horizontal then a vertical pass, each rounded to uint8);
3. rescale by 1/255 and normalize with the CLIP mean/std, fused: ``(x - 255 * mean) / (255 * std)`` in float32;
4. patchify: ``[C, H, W]`` -> ``[H/14 * W/14, C * 2 * 14 * 14]``, patches ordered block-major over the 2x2 merge
   blocks (block row, block col, row in block, col in block), each patch flattened as (channel, time, row, col)
   with the image repeated twice in time (``temporal_patch_size`` 2); ``grid_thw = [1, H/14, W/14]``.

Images of a batch are concatenated in order: ``pixel_values`` is ``[sum of patches, 1176]`` float32.

Where this module differs:

- the resize is a NumPy port of torch's uint8 antialiased bicubic kernel (`resize_bicubic_aa`), bit-exact to
  ``torch.nn.functional.interpolate(uint8, mode="bicubic", antialias=True)`` on the CPU (what transformers runs by
  default), so ``pixel_values`` equal transformers' bit for bit. Pillow's ``Image.resize(BICUBIC)`` is the same
  filter with other integer weights, and Pillow 13 runs the height pass first for some sizes: on photo-like
  images it differs by at most 2 uint8 levels (mean 0.004, up to 0.27 where the pass order differs), on uniform
  noise by up to 26 (overshoots clipped between the passes at other places). transformers on a GPU resizes in
  float32 and differs likewise. Speed: 3000x4000 -> 560x756 in about 0.25 s on one core (Pillow: 0.12 s);
- arrays must be uint8 and channels-last (``[H, W]``, ``[H, W, 1]``, ``[H, W, 3]`` or ``[H, W, 4]``):
  transformers also takes channels-first arrays, guesses the layout when ``H`` is 1, 3 or 4, takes floats, and
  refuses a bare ``[H, W]`` array (as a single image); Pillow is needed only for PIL images;
- ``pixel_values`` is always float32 (transformers keeps uint8 with ``do_rescale=do_normalize=False``);
- ``do_resize=False`` with sides that are not multiples of 28 is a ``ValueError`` (a reshape error there).
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "ImageBatch",
    "ImageProcessor",
    "resize_bicubic_aa",
    "smart_resize",
]

#: OpenAI CLIP's per-channel mean and std (transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD``).
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

DEFAULT_MIN_PIXELS = 56 * 56  # size["shortest_edge"]
DEFAULT_MAX_PIXELS = 451584  # size["longest_edge"] (672 * 672)
MAX_ASPECT_RATIO = 200
#: PIL's BICUBIC (transformers' ``resample`` default), the only resampling this module implements.
PIL_BICUBIC = 3


def _positive_int(value: Any, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """The size an image of ``height x width`` is resized to: ``(resized_height, resized_width)``.

    Both sides are multiples of ``factor`` (patch_size * merge_size), the area is within ``[min_pixels,
    max_pixels]`` (rounding aside) and the aspect ratio is kept as closely as possible; the same arithmetic as
    transformers' ``smart_resize`` (whose own ``max_pixels`` default, 1003520, is not the processor's 451584).

    Raises:
        ValueError: a side or a limit is not positive, or the aspect ratio is more than 200.
    """
    height = _positive_int(height, "height")
    width = _positive_int(width, "width")
    factor = _positive_int(factor, "factor")
    min_pixels = _positive_int(min_pixels, "min_pixels")
    max_pixels = _positive_int(max_pixels, "max_pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)} (image of {height} x {width})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ----------------------------------------------------------------------------------------------- resize


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 (Pillow's and torch's antialiased bicubic), float64."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's ``_compute_index_ranges_int16_weights`` for antialiased bicubic, along one axis.

    Returns ``(index [out, taps] int64, weight [out, taps] int32, precision)``: output ``i`` is
    ``(2**(precision-1) + sum_k weight[i, k] * input[index[i, k]]) >> precision``, clipped to [0, 255]. Taps past
    a window's end have weight 0 (and an index clipped into range).
    """
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # C++ casts to int64 truncate toward zero
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xsize = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin, 0, taps)
    k = np.arange(taps)
    w = _keys_cubic((k[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(k[None, :] < xsize[:, None], w, 0.0)
    total = np.zeros(out_size)
    for j in range(taps):  # torch's summation order, so that the float64 weights round alike
        total = total + w[:, j]
    nonzero = total != 0.0
    w = np.where(nonzero[:, None], w / np.where(nonzero, total, 1.0)[:, None], w)
    wt_max = float(w[nonzero].max()) if nonzero.any() else 0.0
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * float(1 << precision)
    weights = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
    index = np.minimum(xmin[:, None] + k[None, :], in_size - 1)
    return index, weights, precision


def _resample_axis0(x: np.ndarray, out_size: int) -> np.ndarray:
    """One pass of `resize_bicubic_aa` along axis 0 of a C-contiguous uint8 array (rows are gathered whole)."""
    index, weights, precision = _int16_weights(x.shape[0], out_size)
    acc = np.full((out_size, *x.shape[1:]), 1 << (precision - 1), dtype=np.int32)
    term = np.empty_like(acc)
    bshape = (out_size,) + (1,) * (x.ndim - 1)
    for k in range(index.shape[1]):  # one vectorized step per filter tap
        np.multiply(x[index[:, k]], weights[:, k].reshape(bshape), out=term, dtype=np.int32)
        acc += term
    acc >>= precision
    np.clip(acc, 0, 255, out=acc)
    return acc.astype(np.uint8)


def resize_bicubic_aa(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Antialiased bicubic resize of a uint8 ``[H, W, C]`` image to ``[height, width, C]`` uint8.

    Bit-exact to torch's CPU kernel, ``F.interpolate(x, size, mode="bicubic", align_corners=False,
    antialias=True)`` on a uint8 ``[N, C, H, W]`` tensor, which torchvision's ``resize`` (and so transformers)
    calls on uint8 CPU tensors: Keys' cubic (a = -0.5) stretched by the scale when downsampling, int16 weights
    with torch's precision, the width pass first, then the height pass, each rounded and clipped to uint8. A side
    that keeps its size is not resampled. Memory: a transposed copy of the input and about 9 bytes per value of
    each pass's output.
    """
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"resize_bicubic_aa takes a uint8 [H, W, C] array, got {_describe(image)}")
    height = _positive_int(height, "height")
    width = _positive_int(width, "width")
    x = image
    if x.shape[1] != width:
        x = _resample_axis0(np.ascontiguousarray(x.transpose(1, 0, 2)), width).transpose(1, 0, 2)
    if x.shape[0] != height:
        x = _resample_axis0(np.ascontiguousarray(x), height)
    return np.ascontiguousarray(x)


# ----------------------------------------------------------------------------------------------- inputs


def _describe(obj: Any) -> str:
    if isinstance(obj, np.ndarray):
        return f"an array of shape {obj.shape} and dtype {obj.dtype}"
    return f"an object of type {type(obj).__module__}.{type(obj).__qualname__}"


def _pil_image_class() -> type | None:
    """PIL's Image class if Pillow is imported (an object cannot be a PIL image otherwise), else None."""
    module = sys.modules.get("PIL.Image")
    return getattr(module, "Image", None)


def _is_image(obj: Any) -> bool:
    pil_image = _pil_image_class()
    return isinstance(obj, np.ndarray) or (pil_image is not None and isinstance(obj, pil_image))


def _pil_to_rgb_array(image: Any) -> np.ndarray:
    """transformers' ``convert_to_rgb`` for PIL images: transparency composited onto white, then RGB."""
    from PIL import Image

    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb)


def _blend_rgba_on_white(image: np.ndarray) -> np.ndarray:
    """torchvision's RGBA -> RGB of transformers' ``convert_to_rgb`` for arrays, in the same float32 steps."""
    x = image.astype(np.float32) * np.float32(1.0 / 255)
    alpha = x[..., 3:]
    blended = x[..., :3] * alpha + (np.float32(1.0) - alpha)
    return (blended * np.float32(255 + 1.0 - 0.001)).astype(np.uint8)  # to_dtype: truncation of x * 255.999


def _to_rgb_array(image: Any, do_convert_rgb: bool, position: int) -> np.ndarray:
    """One input image -> uint8 ``[H, W, 3]``."""
    where = f"image {position}"
    pil_image = _pil_image_class()
    if pil_image is not None and isinstance(image, pil_image):
        if do_convert_rgb:
            return _pil_to_rgb_array(image)
        array = np.asarray(image)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
            raise ValueError(
                f"{where}: a PIL image in mode {image.mode!r} is not 8-bit RGB; with do_convert_rgb=False only RGB "
                "images are taken"
            )
        return array
    if not isinstance(image, np.ndarray):
        raise TypeError(f"{where}: expected a PIL.Image.Image or a numpy array, got {_describe(image)}")
    if image.dtype != np.uint8:
        raise ValueError(f"{where}: arrays must be uint8 (0..255), got dtype {image.dtype}")
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"{where}: expected an array of shape [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] (channels last), "
            f"got shape {image.shape}"
        )
    channels = image.shape[-1]
    if channels == 3:
        return image
    if not do_convert_rgb:
        raise ValueError(f"{where}: {channels} channels, and do_convert_rgb=False takes only 3 (RGB)")
    if channels == 1:
        return np.repeat(image, 3, axis=-1)
    return _blend_rgba_on_white(image)


# ----------------------------------------------------------------------------------------------- outputs


@dataclasses.dataclass(frozen=True, eq=False)
class ImageBatch:
    """The processed images of one request, as the vision tower takes them.

    Attributes:
        pixel_values: ``[total_patches, channels * temporal_patch_size * patch_size**2]`` float32 (``[N, 1176]``),
            the images' patches concatenated in input order.
        grid_thw: ``[num_images, 3]`` int64, ``(t, h, w)`` per image in patches (t = 1 for an image); image ``i``
            owns ``t * h * w`` rows of ``pixel_values``.
        merge_size: patches merged per side into one token (2: a token is a 2x2 block of patches).
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    merge_size: int = 2

    def __post_init__(self) -> None:
        if self.pixel_values.ndim != 2:
            raise ValueError(f"pixel_values must be [patches, patch_dim], got shape {self.pixel_values.shape}")
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [num_images, 3], got shape {self.grid_thw.shape}")
        patches = int(np.prod(self.grid_thw, axis=1).sum())
        if patches != self.pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw accounts for {patches} patches but pixel_values has {self.pixel_values.shape[0]}"
            )

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    @property
    def num_tokens(self) -> list[int]:
        """Placeholder tokens per image: ``t * h * w // merge_size**2``."""
        return [int(t * h * w) // self.merge_size**2 for t, h, w in self.grid_thw]


# ----------------------------------------------------------------------------------------------- processor


class PatchSizes:
    """The sizes the image and the video processor share (their fields ``patch_size``, ``merge_size``,
    ``temporal_patch_size``, ``do_resize``, ``min_pixels``, ``max_pixels``): one rule for both."""

    _what = "an image's"  # a video processor's error messages say "a frame's"

    @property
    def factor(self) -> int:
        """The multiple both resized sides are (patch_size * merge_size, 28)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per row of ``pixel_values``: 3 * temporal_patch_size * patch_size**2 (1176)."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` an image (a video's frame) of ``height x width`` is processed at."""
        if self.do_resize:
            return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        height, width = _positive_int(height, "height"), _positive_int(width, "width")
        if height % self.factor or width % self.factor:
            raise ValueError(
                f"with do_resize=False, {self._what} sides must be multiples of {self.factor} "
                f"(patch_size * merge_size), got {height} x {width}"
            )
        return height, width


@dataclasses.dataclass(frozen=True)
class ImageProcessor(PatchSizes):
    """MiniMax-M3 VL's image processor (transformers' ``MiniMaxM3VLImageProcessor``) in NumPy.

    The fields and defaults are transformers'; ``min_pixels`` / ``max_pixels`` are its ``size["shortest_edge"]``
    / ``size["longest_edge"]``. Only bicubic resampling exists (transformers' ``resample=3``).

    ``processor(images) -> ImageBatch``; images: a PIL image, a uint8 array (``[H, W]``, ``[H, W, 1]``,
    ``[H, W, 3]`` or ``[H, W, 4]``), or a list/tuple of them.
    """

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is more than max_pixels ({self.max_pixels})")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                value = (value,) * 3
            value = tuple(float(v) for v in value)
            if len(value) != 3:
                raise ValueError(f"{name} must have 3 values (R, G, B), got {len(value)}")
            object.__setattr__(self, name, value)
        if not all(self.image_std):
            raise ValueError(f"image_std has a zero: {self.image_std}")
        if not (isinstance(self.rescale_factor, (int, float)) and self.rescale_factor > 0):
            raise ValueError(f"rescale_factor must be a positive number, got {self.rescale_factor!r}")
        object.__setattr__(self, "rescale_factor", float(self.rescale_factor))

    # ------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ImageProcessor:
        """An image processor from a ``preprocessor_config.json`` dict, in transformers' keys.

        ``size`` is ``{"shortest_edge": min_pixels, "longest_edge": max_pixels}`` (``min_pixels`` /
        ``max_pixels`` inside it are read too); top-level ``min_pixels`` / ``max_pixels`` override it; ``size ==
        [672, 672]`` (what the official checkpoint saved, never used) means the defaults, as in transformers. A
        ``size`` that names only one bound is an error, as it is for transformers when it resizes. Keys of
        transformers' other fields are read, ``null`` meaning the default; other keys (``image_processor_type``,
        ``processor_class``, ...) are ignored.

        Raises:
            ValueError: a ``size`` without both bounds, a ``resample`` other than bicubic (3), a bad value.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"from_dict takes a mapping, got {type(config).__name__}")
        size = config.get("size")
        if size is None or (isinstance(size, (list, tuple)) and list(size) == [672, 672]):
            bounds = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
        elif isinstance(size, Mapping):
            bounds = {
                "shortest_edge": size.get("shortest_edge", size.get("min_pixels")),
                "longest_edge": size.get("longest_edge", size.get("max_pixels")),
            }
        else:
            raise ValueError(f"size must be a dict with shortest_edge and longest_edge, got {size!r}")
        if config.get("min_pixels") is not None:
            bounds["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            bounds["longest_edge"] = config["max_pixels"]
        missing = [key for key, value in bounds.items() if value is None]
        if missing:
            raise ValueError(f"size must give both shortest_edge and longest_edge; {missing} missing in {size!r}")
        resample = config.get("resample")
        if resample is not None and resample != PIL_BICUBIC:
            raise ValueError(f"only bicubic resampling (resample={PIL_BICUBIC}) is implemented, got {resample!r}")
        kwargs: dict[str, Any] = {"min_pixels": bounds["shortest_edge"], "max_pixels": bounds["longest_edge"]}
        for field in dataclasses.fields(cls):
            if field.name not in kwargs and config.get(field.name) is not None:
                kwargs[field.name] = config[field.name]
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """An image processor from a checkpoint directory's ``preprocessor_config.json``.

        A directory without that file gets transformers' defaults (those of this class).

        Raises:
            FileNotFoundError: ``path`` is not a directory.
            ValueError: the file is not a JSON object, or `from_dict` refuses it.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        config_file = path / "preprocessor_config.json"
        if not config_file.is_file():
            return cls()
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
        return cls.from_dict(config)

    # ------------------------------------------------------------------------------------------- sizes

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches of an image of ``height x width`` pixels (t = 1)."""
        resized_height, resized_width = self.resized_size(height, width)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of ``height x width`` pixels: ``t * h * w // merge_size**2``."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size**2

    # ------------------------------------------------------------------------------------------- processing

    def __call__(self, images: Any) -> ImageBatch:
        """Process one image or a list of images.

        Args:
            images: a PIL image, a uint8 array ``[H, W]``, ``[H, W, 1]``, ``[H, W, 3]`` or ``[H, W, 4]``
                (channels last), or a list/tuple of them.

        Returns:
            ImageBatch: ``pixel_values [sum of t*h*w, 3 * temporal_patch_size * patch_size**2]`` float32 and
            ``grid_thw [num_images, 3]`` int64, in input order.

        Raises:
            TypeError: an input that is neither a PIL image nor a numpy array.
            ValueError: an empty list, a wrong array shape or dtype, an aspect ratio over 200.
        """
        if isinstance(images, (list, tuple)):
            if not images:
                raise ValueError("no images: the list is empty")
            batch = list(images)
        elif _is_image(images):
            batch = [images]
        else:
            raise TypeError(f"images: expected a PIL image, a numpy array or a list of them, got {_describe(images)}")
        patches, grids = [], []
        for position, image in enumerate(batch):
            pixel_values, grid = self._process_one(image, position)
            patches.append(pixel_values)
            grids.append(grid)
        pixel_values = patches[0] if len(patches) == 1 else np.concatenate(patches, axis=0)
        return ImageBatch(pixel_values, np.asarray(grids, dtype=np.int64), self.merge_size)

    def _process_one(self, image: Any, position: int) -> tuple[np.ndarray, tuple[int, int, int]]:
        rgb = _to_rgb_array(image, self.do_convert_rgb, position)  # [H, W, 3] uint8
        height, width = rgb.shape[:2]
        if height == 0 or width == 0:
            raise ValueError(f"image {position}: the image is empty ({height} x {width} pixels)")
        resized_height, resized_width = self.resized_size(height, width)
        if (resized_height, resized_width) != (height, width):
            rgb = resize_bicubic_aa(rgb, resized_height, resized_width)
        return self._patchify(self._normalize(rgb)), self.grid(height, width)

    def _normalize(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 ``[H, W, 3]`` -> float32 ``[H, W, 3]``, in transformers' float32 steps (bit-exact)."""
        x = rgb.astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        if self.do_rescale and self.do_normalize:  # fused as transformers: (x - mean/r) / (std/r)
            inverse = np.float32(1.0 / self.rescale_factor)
            return (x - mean * inverse) / (std * inverse)
        if self.do_normalize:
            return (x - mean) / std
        if self.do_rescale:
            return x * np.float32(self.rescale_factor)
        return x

    def _patchify(self, x: np.ndarray) -> np.ndarray:
        """float32 ``[H, W, C]`` -> ``[H/p * W/p, C * T * p * p]`` in transformers' patch order.

        Rows: merge blocks row-major, then the ``merge x merge`` patches of a block row-major; columns: (channel,
        time, row in patch, col in patch), the image repeated ``temporal_patch_size`` times in time.
        """
        height, width, channels = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = x.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
        # -> [block row, block col, row in block, col in block, channel, patch row, patch col]
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return np.ascontiguousarray(blocks).reshape(grid_h * grid_w, channels * t * p * p)
