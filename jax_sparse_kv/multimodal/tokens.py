"""Image placeholders in prompts: expansion as transformers' `MiniMaxM3VLProcessor` does it, and their spans.

A chat prompt holds one ``image_token_id`` per image. Before the model runs,
each becomes ``[image_start_token_id] + [image_token_id] * (t * h * w // merge**2)
+ [image_end_token_id]``: one placeholder per merged patch, whose embedding the
model replaces with that patch's feature. The ids come from the model config
(`jax_sparse_kv.nn.VisionConfig`: config.json, else the checkpoint's tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["expand_image_tokens", "placeholder_spans", "image_token_counts"]


def _vision(config: Any) -> Any:
    vision = getattr(config, "vision", config)
    if vision is None:
        raise ValueError("the model has no vision tower (config.vision is None): it takes no images")
    return vision


def image_token_counts(grid_thw: Any, config: Any) -> list[int]:
    """Placeholders per image: ``t * h * w // merge**2`` for each row of ``grid_thw [images, 3]``."""
    merge = _vision(config).spatial_merge_size
    return [int(n) // merge**2 for n in np.asarray(grid_thw, np.int64).reshape(-1, 3).prod(axis=1)]


def expand_image_tokens(prompt_token_ids: Sequence[int], grid_thw: Any, config: Any) -> list[int]:
    """The prompt with image ``i``'s single ``image_token_id`` expanded for ``grid_thw[i]``.

    Args:
      prompt_token_ids: ids holding exactly one ``image_token_id`` per image, in image order.
      grid_thw: ``[images, 3]`` (t, h, w in patches), as `ImageProcessor` gives it.
      config: a `MiniMaxM3Config` (or its `VisionConfig`) naming the ids.

    Raises:
      ValueError: the prompt's placeholder count differs from the number of images, or the
        start/end ids are unknown (neither config.json nor the tokenizer names them).
    """
    v = _vision(config)
    counts = image_token_counts(grid_thw, config)
    ids = [int(t) for t in prompt_token_ids]
    found = sum(t == v.image_token_id for t in ids)
    if found != len(counts):
        raise ValueError(
            f"the prompt holds {found} image placeholders (token {v.image_token_id}) for {len(counts)} images: "
            "put one placeholder per image, in order"
        )
    if counts and (v.image_start_token_id is None or v.image_end_token_id is None):
        raise ValueError(
            "the image start/end token ids are unknown: config.json names no image_start_token_id / "
            "image_end_token_id and the checkpoint has no tokenizer.json naming ']<]start of image[>[' / "
            "']<]end of image[>['"
        )
    out: list[int] = []
    images = iter(counts)
    for t in ids:
        if t == v.image_token_id:
            out += [v.image_start_token_id] + [v.image_token_id] * next(images) + [v.image_end_token_id]
        else:
            out.append(t)
    return out


def placeholder_spans(expanded_ids: Sequence[int], config: Any) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``image_token_id`` in an expanded prompt, in order."""
    image = _vision(config).image_token_id
    ids = np.asarray(expanded_ids, np.int64)
    is_image = np.concatenate([[False], ids == image, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
