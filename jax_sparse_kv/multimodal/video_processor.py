"""The video processor of MiniMax-M3 VL in NumPy: frames -> ``pixel_values`` and ``grid_thw``, without torch.

What transformers does (``MiniMaxM3VLVideoProcessor``, a ``BaseVideoProcessor``, transformers 5.23), per video:

1. sample frames, only with ``do_sample_frames`` (off by default): ``n = num_frames`` if given, else
   ``max(1, int(total / source_fps * fps))`` (``fps`` the target rate, 1.0 by default), at the indices
   ``i * total // n``; more than ``total`` is an error, and so is sampling by rate without the source fps;
2. convert every frame to RGB as an image is converted (one channel repeated, RGBA blended onto white);
3. resize every frame to ``smart_resize(h, w, 28, min_pixels, max_pixels)`` (the image rule, with the video
   bounds ``4 * 28 * 28`` and ``768 * 28 * 28``), bicubic with antialiasing on uint8 (`resize_bicubic_aa`,
   bit-exact to transformers on the CPU);
4. rescale and normalize (fused, float32: ``(x - 255 * mean) / (255 * std)``);
5. an odd frame count repeats the last frame (``temporal_patch_size`` 2);
6. patchify: ``[T, H, W, C]`` -> ``[T/2 * H/14 * W/14, C * 2 * 14 * 14]``, temporal patch by temporal patch, each
   block-major over the 2x2 merge blocks, each row flattened as (channel, time, row, col);
7. ``video_grid_thw``: the video's ``T/2`` temporal patches cut into rows of at most
   ``vision_segment_max_frames`` (4): ``[[min(4, t - s), h, w] for s in range(0, t, 4)]``. Each row is one
   attention segment of the vision tower and its temporal RoPE positions start again at 0.

Where this module differs: transformers reads ``min_frames``, ``max_frames`` and ``total_pixels`` and never applies
them (neither do we; the engine has its own frame limit); frames must be uint8 arrays (or PIL images), channels
last, all of one size; ``pixel_values`` is always float32.

The source fps (``fps=`` of `VideoProcessor.__call__`, transformers' ``video_metadata.fps``) gives each temporal
patch its timestamp ``frames_indices[2 i] / source_fps`` (`VideoBatch.timestamps`); without it there are no
timestamps, as transformers' processor writes none without metadata.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_sparse_kv.multimodal.image_processor import (
    CLIP_MEAN,
    CLIP_STD,
    PIL_BICUBIC,
    PatchSizes,
    _describe,
    _is_image,
    _positive_int,
    _to_rgb_array,
    resize_bicubic_aa,
)

__all__ = ["VideoBatch", "VideoProcessor", "sample_frame_indices"]

DEFAULT_VIDEO_MIN_PIXELS = 4 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 768 * 28 * 28


def sample_frame_indices(
    total_frames: int, source_fps: float | None, fps: float | None = 1.0, num_frames: int | None = None
) -> np.ndarray:
    """transformers' ``default_sample_indices_fn``: the frame indices kept out of ``total_frames``.

    ``num_frames`` frames if given, else ``max(1, int(total / source_fps * fps))``; at ``i * total // n``.
    (transformers refuses ``num_frames`` with its default ``fps`` 1.0 unless ``fps`` is set to None: here
    ``num_frames`` wins.)

    Raises:
        ValueError: more frames than the video has, or a rate without ``source_fps``.
    """
    total = _positive_int(total_frames, "total_frames")
    if num_frames is None and fps is not None:
        if source_fps is None:
            raise ValueError(f"sampling {fps} frames per second needs the video's own fps (source fps)")
        num_frames = max(1, int(total / source_fps * fps))
    if num_frames is None:
        return np.arange(total)
    num_frames = _positive_int(num_frames, "num_frames")
    if num_frames > total:
        raise ValueError(f"sampling {num_frames} frames from a video of {total} frames: lower num_frames or fps")
    return np.arange(num_frames, dtype=np.int64) * total // num_frames


@dataclasses.dataclass(frozen=True, eq=False)
class VideoBatch:
    """One processed video, as the vision tower and the prompt take it.

    Attributes:
        pixel_values: ``[t * h * w, channels * temporal_patch_size * patch_size**2]`` float32 (transformers'
            ``pixel_values_videos`` of this video), temporal patch after temporal patch.
        grid_thw: ``[rows, 3]`` int64 (transformers' ``video_grid_thw`` rows of this video): ``(t_i, h, w)`` with
            ``sum(t_i) = t`` and each ``t_i <= vision_segment_max_frames``.
        frames_indices: ``[frames]`` the source frame of each processed frame (before temporal padding).
        fps: the source video's frames per second, or None (then there are no timestamps).
        merge_size: patches merged per side into one token.
        temporal_patch_size: frames per temporal patch.
    """

    pixel_values: np.ndarray
    grid_thw: np.ndarray
    frames_indices: np.ndarray
    fps: float | None = None
    merge_size: int = 2
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        if self.pixel_values.ndim != 2:
            raise ValueError(f"pixel_values must be [patches, patch_dim], got shape {self.pixel_values.shape}")
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3 or len(self.grid_thw) == 0:
            raise ValueError(f"grid_thw must be [rows >= 1, 3], got shape {self.grid_thw.shape}")
        if len({(int(h), int(w)) for _, h, w in self.grid_thw}) != 1:
            raise ValueError(f"the rows of one video's grid_thw must share h and w, got {self.grid_thw.tolist()}")
        patches = int(np.prod(self.grid_thw, axis=1).sum())
        if patches != self.pixel_values.shape[0]:
            raise ValueError(f"grid_thw accounts for {patches} patches but pixel_values has {len(self.pixel_values)}")

    @property
    def num_temporal_patches(self) -> int:
        """``t``: temporal patches of the video (``ceil(frames / temporal_patch_size)``)."""
        return int(self.grid_thw[:, 0].sum())

    @property
    def tokens_per_frame(self) -> int:
        """Placeholder tokens of one temporal patch: ``h * w // merge**2``."""
        _, h, w = (int(x) for x in self.grid_thw[0])
        return h * w // self.merge_size**2

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of the whole video: ``t * h * w // merge**2``."""
        return self.num_temporal_patches * self.tokens_per_frame

    @property
    def timestamps(self) -> list[float] | None:
        """Seconds of each temporal patch: ``frames_indices[min(p * temporal, frames - 1)] / fps`` (None without
        fps), as transformers' processor writes them before each temporal patch."""
        if self.fps is None:
            return None
        idx = self.frames_indices
        return [
            float(idx[min(p * self.temporal_patch_size, len(idx) - 1)]) / self.fps
            for p in range(self.num_temporal_patches)
        ]


@dataclasses.dataclass(frozen=True)
class VideoProcessor(PatchSizes):
    """MiniMax-M3 VL's video processor (transformers' ``MiniMaxM3VLVideoProcessor``) in NumPy.

    The fields and defaults are transformers'. ``fps`` is the *target* sampling rate of ``do_sample_frames``
    (transformers' ``fps``); the source video's rate is the ``fps`` argument of `__call__`.
    ``min_frames`` / ``max_frames`` / ``total_pixels`` are kept and, as in transformers, not applied.

    ``vproc(frames, fps=30.0) -> VideoBatch``; frames: a uint8 array ``[T, H, W, 3]`` (or ``[T, H, W]``,
    ``[T, H, W, 1]``, ``[T, H, W, 4]``), or a list of images (PIL or uint8 ``[H, W, C]``) of one size.
    """

    min_pixels: int = DEFAULT_VIDEO_MIN_PIXELS
    max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS
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
    do_sample_frames: bool = False
    fps: float = 1.0
    num_frames: int | None = None
    vision_segment_max_frames: int | None = 4
    min_frames: int = 4
    max_frames: int = 768
    total_pixels: int = int(64000 * 28 * 28 * 0.9)

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is more than max_pixels ({self.max_pixels})")
        if self.vision_segment_max_frames is not None:
            _positive_int(self.vision_segment_max_frames, "vision_segment_max_frames")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            value = tuple(float(v) for v in ((value,) * 3 if isinstance(value, (int, float)) else value))
            if len(value) != 3:
                raise ValueError(f"{name} must have 3 values (R, G, B), got {len(value)}")
            object.__setattr__(self, name, value)
        if not all(self.image_std):
            raise ValueError(f"image_std has a zero: {self.image_std}")
        if not (isinstance(self.fps, (int, float)) and self.fps > 0):
            raise ValueError(f"fps (the sampling rate) must be a positive number, got {self.fps!r}")

    # ------------------------------------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VideoProcessor:
        """A video processor from a video preprocessor config dict, in transformers' keys (``null``: the default).

        ``size`` is ignored, as transformers' video processor ignores it (``min_pixels`` / ``max_pixels`` bound a
        frame); other unknown keys (``video_processor_type``, ...) are ignored.

        Raises:
            ValueError: a ``resample`` other than bicubic (3), a bad value.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"from_dict takes a mapping, got {type(config).__name__}")
        resample = config.get("resample")
        if resample is not None and resample != PIL_BICUBIC:
            raise ValueError(f"only bicubic resampling (resample={PIL_BICUBIC}) is implemented, got {resample!r}")
        kwargs = {f.name: config[f.name] for f in dataclasses.fields(cls) if config.get(f.name) is not None}
        if "vision_segment_max_frames" in config:  # null is meaningful here: one segment per video
            kwargs["vision_segment_max_frames"] = config["vision_segment_max_frames"]
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VideoProcessor:
        """A video processor from a checkpoint directory, found as transformers finds it: ``processor_config.json``'s
        ``video_processor`` entry, else ``video_preprocessor_config.json``, else ``preprocessor_config.json``;
        none of them: the defaults.

        Raises:
            FileNotFoundError: ``path`` is not a directory.
            ValueError: a file that is not a JSON object, or `from_dict` refuses it.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        nested = path / "processor_config.json"
        if nested.is_file():
            config = _read_json(nested)
            if isinstance(config.get("video_processor"), Mapping):
                return cls.from_dict(config["video_processor"])
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (path / name).is_file():
                return cls.from_dict(_read_json(path / name))
        return cls()

    # ------------------------------------------------------------------------------------------- sizes

    _what = "a frame's"  # (factor, patch_dim and resized_size: `PatchSizes`, the image processor's rule)

    def grid_rows(self, num_frames: int, height: int, width: int) -> np.ndarray:
        """``video_grid_thw [rows, 3]`` of a video of ``num_frames`` (processed) frames of ``height x width``."""
        h, w = (s // self.patch_size for s in self.resized_size(height, width))
        t = -(-_positive_int(num_frames, "num_frames") // self.temporal_patch_size)
        step = t if self.vision_segment_max_frames is None else self.vision_segment_max_frames
        return np.asarray([[min(step, t - s), h, w] for s in range(0, t, step)], np.int64)

    def num_video_tokens(self, num_frames: int, height: int, width: int) -> int:
        """Placeholder tokens of a video: ``t * h * w // merge**2``."""
        return int(self.grid_rows(num_frames, height, width).prod(axis=1).sum()) // self.merge_size**2

    # ------------------------------------------------------------------------------------------- processing

    def __call__(self, frames: Any, fps: float | None = None) -> VideoBatch:
        """Process one video.

        Args:
            frames: uint8 ``[T, H, W, C]`` (C in 1, 3, 4; or ``[T, H, W]``), or a list of ``T`` images.
            fps: the source video's frames per second (transformers' ``video_metadata.fps``): the timestamps,
                and the rate ``do_sample_frames`` samples from. None: no timestamps.

        Returns:
            VideoBatch: ``pixel_values [t * h * w, patch_dim]`` float32, ``grid_thw [rows, 3]`` int64.

        Raises:
            TypeError: frames that are neither an array nor a list of images.
            ValueError: no frames, frames of different sizes, a wrong dtype or shape, a bad fps.
        """
        if fps is not None and not (
            isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0 and math.isfinite(fps)
        ):
            raise ValueError(f"fps must be a positive number or None, got {fps!r}")
        if isinstance(frames, np.ndarray):
            if frames.ndim not in (3, 4):
                raise ValueError(f"a video array must be [T, H, W] or [T, H, W, C], got shape {frames.shape}")
            frame_list: Sequence[Any] = list(frames)
        elif isinstance(frames, (list, tuple)):
            frame_list = list(frames)
        else:
            raise TypeError(f"frames: expected a [T, H, W, C] uint8 array or a list of images, got {_describe(frames)}")
        if not frame_list:
            raise ValueError("the video has no frames")
        for i, frame in enumerate(frame_list):
            if not _is_image(frame):
                raise TypeError(f"frame {i}: expected a PIL image or a numpy array, got {_describe(frame)}")
        indices = np.arange(len(frame_list))
        if self.do_sample_frames:
            indices = sample_frame_indices(len(frame_list), fps, None if self.num_frames else self.fps, self.num_frames)
        rgb = [_to_rgb_array(frame_list[int(i)], self.do_convert_rgb, int(i)) for i in indices]
        sizes = {f.shape[:2] for f in rgb}
        if len(sizes) != 1:
            raise ValueError(f"the frames of a video must share one size, got {sorted(sizes)}")
        height, width = rgb[0].shape[:2]
        if height == 0 or width == 0:
            raise ValueError(f"the frames are empty ({height} x {width} pixels)")
        rh, rw = self.resized_size(height, width)
        if (rh, rw) != (height, width):
            rgb = [resize_bicubic_aa(f, rh, rw) for f in rgb]
        x = self._normalize(np.stack(rgb))  # [T, H, W, 3]
        if pad := -len(x) % self.temporal_patch_size:
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        grid = self.grid_rows(len(indices), height, width)
        return VideoBatch(
            self._patchify(x),
            grid,
            indices.astype(np.int64),
            None if fps is None else float(fps),
            self.merge_size,
            self.temporal_patch_size,
        )

    def _normalize(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 ``[..., 3]`` -> float32, in transformers' float32 steps."""
        x = rgb.astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        if self.do_rescale and self.do_normalize:
            inverse = np.float32(1.0 / self.rescale_factor)
            return (x - mean * inverse) / (std * inverse)
        if self.do_normalize:
            return (x - mean) / std
        if self.do_rescale:
            return x * np.float32(self.rescale_factor)
        return x

    def _patchify(self, x: np.ndarray) -> np.ndarray:
        """float32 ``[T, H, W, C]`` (T a multiple of temporal) -> ``[T/tp * H/p * W/p, C * tp * p * p]``."""
        frames, height, width, channels = x.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = frames // tp, height // p, width // p
        blocks = x.reshape(gt, tp, gh // m, m, p, gw // m, m, p, channels)
        # -> [temporal patch, block row, block col, row in block, col in block, channel, time, patch row, patch col]
        blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        return np.ascontiguousarray(blocks).reshape(gt * gh * gw, channels * tp * p * p)


def _read_json(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config
