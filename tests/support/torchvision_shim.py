"""A minimal stand-in for torchvision, so that transformers' real ``MiniMaxM3VLImageProcessor`` runs in the tests.

Why: transformers' image processor module imports ``torchvision.transforms.v2.functional`` at the top and is a
``TorchvisionBackend``; the torchvision wheel on PyPI here is a CUDA build that does not load with this project's
CPU torch 2.13, so torchvision is not installed.

What it replaces - only what transformers 5.25 touches on the way from a PIL image / uint8 array to
``pixel_values``, each written after torchvision's own code (``transforms/v2/functional/_geometry.py``,
``_color.py``, ``_misc.py``) with the same torch ops:

- ``torchvision.transforms.InterpolationMode`` (and in ``transforms.functional`` / ``transforms.v2.functional``):
  the enum, same names and values;
- ``torchvision.transforms.v2.functional.resize`` (``resize_image`` for tensors, ``size=[h, w]``): returns the
  input when the size is unchanged; bicubic and bilinear call ``torch.nn.functional.interpolate(...,
  align_corners=False, antialias=antialias)``, on uint8 directly on the CPU for bicubic (and for bilinear where
  the CPU has AVX2), as torchvision's ``_do_native_uint8_resize_on_cpu`` decides, otherwise in float32, then
  clamped (bicubic), rounded and cast back; nearest modes call ``interpolate`` without antialiasing
  (torchvision's channels-last restriding, which changes no value, is left out; so is ``max_size``);
- ``torchvision.transforms.v2.functional.normalize`` (``normalize_image``): ``(x - mean) / std`` as
  ``sub`` then ``div_``;
- ``torchvision.transforms.v2.functional.grayscale_to_rgb``: a 1-channel image repeated to 3 channels;
- ``torchvision.transforms.v2.functional.to_dtype`` (``to_dtype_image``): int -> float is ``x / max``, float ->
  int is ``(x * (max + 1 - 0.001)).to(dtype)`` (truncation);
- ``torchvision.transforms.functional.pil_to_tensor``: ``[C, H, W]`` uint8 from a PIL image (imported by
  transformers' ``image_utils``, unused on this path);
- ``torchvision.io``: imported by transformers' ``video_utils``; its functions (video and image decoding) raise.

Anything else raises ``NotImplementedError``. `installed()` puts these modules into ``sys.modules``, clears
transformers' cached ``is_torchvision_available`` and, for transformers modules imported before (which decided
then that torchvision was missing), sets the names they would have imported; on exit it restores all of that.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

__version__ = "0.28.0+shim"  # what transformers reads as torchvision's version (a 0.28 API is mimicked)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_FROM_INT = {
    0: InterpolationMode.NEAREST,
    2: InterpolationMode.BILINEAR,
    3: InterpolationMode.BICUBIC,
    4: InterpolationMode.BOX,
    5: InterpolationMode.HAMMING,
    1: InterpolationMode.LANCZOS,
}


def _check_interpolation(interpolation) -> InterpolationMode:
    if isinstance(interpolation, int):
        return _FROM_INT[interpolation]
    if not isinstance(interpolation, InterpolationMode):
        raise ValueError(f"interpolation must be an InterpolationMode or an int, got {interpolation!r}")
    return interpolation


def _do_native_uint8_resize_on_cpu(interpolation: InterpolationMode) -> bool:
    if interpolation == InterpolationMode.BILINEAR:
        return "AVX2" in torch.backends.cpu.get_cpu_capability()
    return interpolation == InterpolationMode.BICUBIC


def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    """torchvision's ``resize_image`` for tensors ``[..., C, H, W]`` with ``size=[height, width]``."""
    if not isinstance(image, torch.Tensor):
        raise NotImplementedError(f"the shim resizes tensors only, got {type(image)}")
    if max_size is not None or len(size) != 2:
        raise NotImplementedError(f"the shim takes size=[height, width] only, got size={size}, max_size={max_size}")
    interpolation = _check_interpolation(interpolation)
    if interpolation not in (
        InterpolationMode.BILINEAR,
        InterpolationMode.BICUBIC,
        InterpolationMode.NEAREST,
        InterpolationMode.NEAREST_EXACT,
    ):
        raise NotImplementedError(f"the shim does not resize with {interpolation}")
    antialias = False if antialias is None else antialias
    align_corners = None
    if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        align_corners = False
    else:
        antialias = False
    shape = image.shape
    num_channels, old_height, old_width = shape[-3:]
    new_height, new_width = int(size[0]), int(size[1])
    if (new_height, new_width) == (old_height, old_width):
        return image
    if image.numel() > 0:
        dtype = image.dtype
        acceptable_dtypes = [torch.float32, torch.float64]
        if interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
            acceptable_dtypes.append(torch.uint8)
        elif image.device.type == "cpu" and _do_native_uint8_resize_on_cpu(interpolation):
            acceptable_dtypes.append(torch.uint8)
        image = image.reshape(-1, num_channels, old_height, old_width)
        need_cast = dtype not in acceptable_dtypes
        if need_cast:
            image = image.to(dtype=torch.float32)
        image = F.interpolate(
            image,
            size=[new_height, new_width],
            mode=interpolation.value,
            align_corners=align_corners,
            antialias=antialias,
        )
        if need_cast:
            if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
                image = image.clamp_(min=0, max=255)
            if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
                image = image.round_()
            image = image.to(dtype=dtype)
    return image.reshape(shape[:-3] + (num_channels, new_height, new_width))


def normalize(image, mean, std, inplace=False):
    """torchvision's ``normalize_image``."""
    if not image.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {image.dtype}.")
    if image.ndim < 3:
        raise ValueError(f"Expected tensor to be a tensor image of size (..., C, H, W). Got {image.shape}.")
    if isinstance(std, (tuple, list)):
        divzero = not all(std)
    elif isinstance(std, (int, float)):
        divzero = std == 0
    else:
        divzero = False
    if divzero:
        raise ValueError("std evaluated to zero, leading to division by zero.")
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
    if mean.ndim == 1:
        mean = mean.view(-1, 1, 1)
    if std.ndim == 1:
        std = std.view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def grayscale_to_rgb(image):
    """torchvision's ``grayscale_to_rgb_image``: 3+ channels unchanged, 1 channel repeated to 3."""
    if image.shape[-3] >= 3:
        return image
    if image.shape[-3] != 1:
        raise NotImplementedError(f"the shim converts 1-channel images only, got shape {tuple(image.shape)}")
    repeats = [1] * image.ndim
    repeats[-3] = 3
    return image.repeat(repeats)


def _max_value(dtype: torch.dtype) -> int:
    if dtype == torch.uint8:
        return 255
    if dtype.is_floating_point:
        return 1
    return torch.iinfo(dtype).max


def to_dtype(image, dtype=torch.float, scale=False):
    """torchvision's ``to_dtype_image`` (float <-> uint8 scaling only)."""
    if image.dtype == dtype:
        return image
    if not scale:
        return image.to(dtype)
    if image.is_floating_point():
        if dtype.is_floating_point:
            return image.to(dtype)
        return image.mul(float(_max_value(dtype)) + 1.0 - 1e-3).to(dtype)
    if dtype.is_floating_point:
        return image.to(dtype).mul_(1.0 / _max_value(image.dtype))
    raise NotImplementedError(f"the shim does not scale {image.dtype} to {dtype}")


def pil_to_tensor(pic):
    """``[C, H, W]`` tensor of a PIL image's values."""
    array = np.array(pic, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _not_implemented(name: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"torchvision shim: {name} is not implemented")

    fail.__name__ = name
    return fail


def _module(name: str, package: bool = True, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    module.__file__ = __file__
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    return module


def build_modules() -> dict[str, types.ModuleType]:
    """The shim's modules by dotted name."""
    v2_functional = _module(
        "torchvision.transforms.v2.functional",
        package=False,
        InterpolationMode=InterpolationMode,
        resize=resize,
        normalize=normalize,
        grayscale_to_rgb=grayscale_to_rgb,
        to_dtype=to_dtype,
        pad=_not_implemented("pad"),
        crop=_not_implemented("crop"),
    )
    v2 = _module("torchvision.transforms.v2", functional=v2_functional)
    functional = _module(
        "torchvision.transforms.functional",
        package=False,
        InterpolationMode=InterpolationMode,
        pil_to_tensor=pil_to_tensor,
    )
    transforms = _module("torchvision.transforms", InterpolationMode=InterpolationMode, functional=functional, v2=v2)
    io = _module(
        "torchvision.io",
        package=False,
        read_video=_not_implemented("io.read_video"),
        decode_image=_not_implemented("io.decode_image"),
        ImageReadMode=enum.Enum("ImageReadMode", ["UNCHANGED", "GRAY", "GRAY_ALPHA", "RGB", "RGB_ALPHA"]),
    )
    torchvision = _module("torchvision", transforms=transforms, io=io, __version__=__version__)
    return {
        "torchvision": torchvision,
        "torchvision.io": io,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
        "torchvision.transforms.v2": v2,
        "torchvision.transforms.v2.functional": v2_functional,
    }


def _clear_transformers_caches() -> None:
    from transformers.utils import import_utils

    for name in ("is_torchvision_available", "is_torchvision_v2_available", "is_torchvision_greater_or_equal"):
        getattr(import_utils, name).cache_clear()


@contextlib.contextmanager
def installed() -> Iterator[dict[str, types.ModuleType]]:
    """The shim in ``sys.modules`` (refusing to shadow a real torchvision) for the duration of the block."""
    if "torchvision" in sys.modules and getattr(sys.modules["torchvision"], "__version__", "") != __version__:
        raise RuntimeError("a real torchvision is imported; the shim would shadow it")
    modules = build_modules()
    with contextlib.ExitStack() as stack:
        stack.callback(_clear_transformers_caches)  # runs last: after sys.modules is restored
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        for name, module in modules.items():
            patch.setitem(sys.modules, name, module)
        _clear_transformers_caches()
        # transformers modules imported before decided then that torchvision was missing: give them its names
        from transformers import image_processing_backends, image_processing_utils, image_utils, video_processing_utils
        from transformers.models import auto as auto_package

        # a process that asked transformers.models.auto for video_processing_auto before the shim holds a dummy
        # there (torchvision was missing), which processor modules' docstrings then read: give it the module
        video_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
        if not isinstance(getattr(auto_package, "video_processing_auto", None), types.ModuleType):
            patch.setattr(auto_package, "video_processing_auto", video_auto, raising=False)

        resampling = image_utils.PILImageResampling
        mapping = {
            resampling.NEAREST: InterpolationMode.NEAREST_EXACT,
            resampling.BOX: InterpolationMode.BOX,
            resampling.BILINEAR: InterpolationMode.BILINEAR,
            resampling.HAMMING: InterpolationMode.HAMMING,
            resampling.BICUBIC: InterpolationMode.BICUBIC,
            resampling.LANCZOS: InterpolationMode.LANCZOS,
        }
        inverse = {v: k for k, v in mapping.items()}
        # (video_processing_utils too: a worker that imported it before the shim has no tvF there)
        for module in (image_processing_utils, image_processing_backends, video_processing_utils):
            if getattr(module, "tvF", None) is None:
                patch.setattr(module, "tvF", modules["torchvision.transforms.v2.functional"], raising=False)
        for module in (image_utils, image_processing_backends):
            if not getattr(module, "pil_torch_interpolation_mapping", None):
                patch.setattr(module, "pil_torch_interpolation_mapping", mapping, raising=False)
                patch.setattr(module, "torch_pil_interpolation_mapping", inverse, raising=False)
        if getattr(image_utils, "InterpolationMode", None) is None:
            patch.setattr(image_utils, "InterpolationMode", InterpolationMode, raising=False)
            patch.setattr(image_utils, "pil_to_tensor", pil_to_tensor, raising=False)
        yield modules
