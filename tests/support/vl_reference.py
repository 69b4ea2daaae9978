"""transformers' MiniMax-M3 VL as the reference: a tiny random VL model, its checkpoint, image inputs.

Used by tests/test_m3_vision.py and the engine/server image tests. The model is
`MiniMaxM3SparseForConditionalGeneration` (transformers >= 5.23) with random weights
wide enough to make choices sharp, non-trivial norms and biases (transformers' own
init leaves biases zero and LayerNorm weights one).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config
from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config


def vl_config(**vision: object) -> MiniMaxM3Config:
    """The tiny text model of the tests with a 2-layer vision tower (ids 250/251/252: image/start/end)."""
    return tiny_config(vision=tiny_vision_config(**vision))


def reference_vl_model(config: MiniMaxM3Config, seed: int = 0):
    import torch
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    d = config.to_hf_vl()
    d["text_config"] = {**d["text_config"], "bos_token_id": None, "eos_token_id": None}
    hf = MiniMaxM3VLConfig(**d)
    for c in (hf, hf.text_config, hf.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MiniMaxM3SparseForConditionalGeneration(hf).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if "norm" in name else 0.1 if "e_score" in name else 0.15
            is_ln_scale = ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if is_ln_scale else 0.0))
    return model


def random_pixels(grid_thw: np.ndarray, seed: int = 0, patch_dim: int = 1176) -> np.ndarray:
    """``[patches, patch_dim]`` float32 pixel rows for ``grid_thw`` (normalised-image-like values)."""
    n = int(np.asarray(grid_thw).prod(axis=1).sum())
    return np.random.default_rng(seed).standard_normal((n, patch_dim)).astype(np.float32)


def prompt_with_images(config: MiniMaxM3Config, grid_thw: np.ndarray, text: list[list[int]]) -> list[int]:
    """``text[0] <image 0> text[1] <image 1> ... text[-1]`` with each image expanded as transformers' processor does."""
    v = config.vision
    ids = list(text[0])
    for i, (t, h, w) in enumerate(np.asarray(grid_thw).tolist()):
        ids += [v.image_start_token_id] + [v.image_token_id] * (t * h * w // v.spatial_merge_size**2)
        ids += [v.image_end_token_id] + list(text[i + 1])
    return ids


# ---------------------------------------------------------------------- sharp random VL models, images


def sharp_vl_model(seed: int = 0) -> MiniMaxM3:
    """The tiny VL model (`vl_config`) with `sharpen`ed random weights."""
    return sharpen(MiniMaxM3(vl_config(), seed=seed), seed)


def sharpen(model: MiniMaxM3, seed: int) -> MiniMaxM3:
    """Random weights wide enough that greedy choices are far from ties (std 0.15; norms around their identity)."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            name = ".".join(str(p) for p in path)
            value = rng.standard_normal(var.shape).astype(np.float32) * (0.3 if "norm" in name else 0.15)
            if ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight"):
                value += 1.0
            var.set_value(jnp.asarray(value))
    return model


def image(h: int, w: int, seed: int) -> np.ndarray:
    """A random ``[h, w, 3]`` uint8 RGB image."""
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


IMG1, IMG2, IMG3 = image(56, 56, 1), image(56, 84, 2), image(84, 112, 3)  # 4, 6 and 12 placeholders
