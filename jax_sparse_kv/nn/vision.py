"""MiniMax-M3's vision tower and projector in Flax NNX.

The architecture of transformers' `MiniMaxM3VLVisionModel` and
`MiniMaxM3VLMultiModalProjector` (>= 5.23, its reference), top to bottom:

- Patch embedding: a Conv3d with kernel = stride = ``(temporal, patch, patch)``
  and no bias, i.e. a matmul of each ``[channels * temporal * patch * patch]``
  row of ``pixel_values`` (1176 wide for M3) with the kernel flattened; the
  kernel keeps the checkpoint's 5-D shape ``[hidden, channels, t, p, p]``.
- ``pre_layrnorm`` (LayerNorm with bias), then pre-LN encoder layers:
  ``x + attn(layer_norm1(x))``, ``x + fc2(gelu(fc1(layer_norm2(x))))``;
  q/k/v/out projections with bias, exact (erf) GELU; **no post-layernorm**.
- Attention is bidirectional inside one image (a video chunk: across its
  frames), never across images; softmax scale ``head_dim ** -0.5``.
- 3-D partial RoPE: each patch has a position ``(t, h, w)``, laid out
  block-major over the ``merge x merge`` blocks the projector merges; each axis
  rotates ``2 * ((head_dim // 3) // 2)`` channels with its own copy of the
  frequencies ``theta ** (-2i / that)``; the angles of the three axes are
  concatenated and repeated twice (NeoX half-split rotation of the first
  ``rope_dim`` channels; the last ``head_dim - rope_dim`` pass). cos/sin in f32.
- Projector: per patch ``linear_2(gelu(linear_1(x)))`` to the text width,
  then each ``merge ** 2`` consecutive patches (one merge block) concatenated,
  then ``merge_linear_2(gelu(merge_linear_1(.)))``: one text token per block.

Parameter names are transformers' (``model.vision_tower.layers.{i}.self_attn.q_proj.weight``,
``model.multi_modal_projector.merge_linear_1.bias``, ...); the release's names
(``vision_tower.vision_model.encoder.layers.{i}...``, ``patch_merge_mlp.linear_1``)
are mapped in `jax_sparse_kv.nn.weights`.

Shapes are static per call: `vision_inputs` lays out the host-side positions
and segment ids of a batch of images, padded to one of a bounded set of patch
counts (`patch_bucket`), so a new image size reuses a compiled program.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv.nn.config import VisionConfig
from jax_sparse_kv.nn.init import Init

__all__ = [
    "VisionTower",
    "MultiModalProjector",
    "vision_positions",
    "vision_inputs",
    "vision_rope",
    "patch_bucket",
]


class BiasLinear(nnx.Module):
    """``y = x @ weight.T + bias`` with ``weight [out, in]``, ``bias [out]`` (bias optional)."""

    def __init__(self, in_features: int, out_features: int, *, init: Init, bias: bool = True):
        self.weight = init.normal(out_features, in_features)
        if bias:
            self.bias = init.zeros(out_features)
        self.has_bias = bias

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...])
        return y + self.bias[...] if self.has_bias else y


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with ``weight`` (ones) and ``bias`` (zeros), computed in f32."""

    def __init__(self, dim: int, eps: float, *, init: Init):
        self.weight = init.ones(dim)
        self.bias = init.zeros(dim)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, transformers' ``"gelu"``."""
    return jax.nn.gelu(x, approximate=False)


# ---------------------------------------------------------------------- positions


def vision_positions(grid_thw: Any, merge: int) -> np.ndarray:
    """``[patches, 3]`` int32 ``(t, h, w)`` of every patch of ``grid_thw [images, 3]``, in pixel_values order.

    Within a frame, patches are block-major over ``merge x merge`` blocks (the
    image processor's order): block rows, block columns, then the rows and
    columns inside a block. Frames follow each other.
    """
    out = []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        if h % merge or w % merge:
            raise ValueError(f"grid (t={t}, h={h}, w={w}): h and w must be multiples of the merge size {merge}")
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        tt = np.repeat(np.arange(t), h * w)
        out.append(np.stack([tt, np.tile(hh, t), np.tile(ww, t)], axis=-1))
    return np.concatenate(out).astype(np.int32) if out else np.zeros((0, 3), np.int32)


def patch_bucket(patches: int, multiple: int = 4) -> int:
    """The padded patch count of a batch of ``patches``: 64, 96, 128, 192, ... 768, 1024 (powers of two and 1.5x
    them), then multiples of 256 (1280, 1536, ..., 2304 = an image at the default max pixels, 672 x 672, exactly):
    a few compiled programs per doubling of image size, and at most 256 padded patches on large images."""
    n = 64
    while n < patches and n < 1024:
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    if n < patches:
        n = -(-patches // 256) * 256
    return int(math.ceil(n / multiple) * multiple)


def vision_inputs(grid_thw: Any, merge: int, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host-side inputs of `VisionTower` for images ``grid_thw [images, 3]``.

    Returns ``(positions [P, 3] int32, segments [P] int32)``: image ``i``'s
    patches have segment ``i`` (attention never crosses segments); rows past
    the real patches (up to ``pad_to``) are padding, segment ``-1``.
    """
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    positions = vision_positions(grid, merge)
    segments = np.repeat(np.arange(len(grid), dtype=np.int32), grid.prod(axis=1))
    n = len(segments)
    if pad_to is not None:
        if pad_to < n:
            raise ValueError(f"pad_to={pad_to} is less than the {n} patches of the images")
        positions = np.concatenate([positions, np.zeros((pad_to - n, 3), np.int32)])
        segments = np.concatenate([segments, np.full(pad_to - n, -1, np.int32)])
    return positions, segments


def vision_rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [P, rope_dim]`` f32 of the 3-D RoPE at ``positions [P, 3]`` (t, h, w)."""
    axis_dim = 2 * ((head_dim // 3) // 2)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, axis_dim, 2, dtype=jnp.float32) / axis_dim))
    freqs = (positions.astype(jnp.float32)[..., None] * inv_freq).reshape(positions.shape[0], -1)  # t.., h.., w..
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX rotation of the first ``cos.shape[-1]`` channels of ``x [P, heads, dim]``."""
    r = cos.shape[-1]
    rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


# ---------------------------------------------------------------------- tower


class Conv3dKernel(nnx.Module):
    """The patch Conv3d's ``weight [hidden, channels, temporal, patch, patch]`` (no bias)."""

    def __init__(self, c: VisionConfig, *, init: Init):
        self.weight = init.normal(c.hidden_size, c.num_channels, c.temporal_patch_size, c.patch_size, c.patch_size)


class PatchEmbedding(nnx.Module):
    """The Conv3d patch embedding as a matmul: ``[P, patch_dim] -> [P, hidden]``; ``proj.weight`` is
    ``[hidden, channels, temporal, patch, patch]`` as in the checkpoint."""

    def __init__(self, c: VisionConfig, *, init: Init):
        self.proj = Conv3dKernel(c, init=init)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        w = self.proj.weight[...]
        return jnp.einsum("pi,oi->po", pixels.astype(w.dtype), w.reshape(w.shape[0], -1))


class VisionAttention(nnx.Module):
    def __init__(self, c: VisionConfig, *, init: Init):
        d = c.hidden_size
        self.k_proj = BiasLinear(d, d, init=init)
        self.v_proj = BiasLinear(d, d, init=init)
        self.q_proj = BiasLinear(d, d, init=init)
        self.out_proj = BiasLinear(d, d, init=init)
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segments: jax.Array) -> jax.Array:
        """``x [P, hidden]``, ``segments [P]`` -> ``[P, hidden]``: attention inside each segment."""
        p = x.shape[0]
        q = self.q_proj(x).reshape(p, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(p, self.num_heads, self.head_dim)
        v = self.v_proj(x).reshape(p, self.num_heads, self.head_dim)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * self.head_dim**-0.5
        same = segments[:, None] == segments[None, :]
        probs = jax.nn.softmax(jnp.where(same[None], scores, -jnp.inf), axis=-1).astype(v.dtype)
        out = jnp.einsum("hqk,khd->qhd", probs, v).reshape(p, -1)
        return self.out_proj(out)


class VisionMLP(nnx.Module):
    def __init__(self, c: VisionConfig, *, init: Init):
        self.fc1 = BiasLinear(c.hidden_size, c.intermediate_size, init=init)
        self.fc2 = BiasLinear(c.intermediate_size, c.hidden_size, init=init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(gelu(self.fc1(x)))


class VisionEncoderLayer(nnx.Module):
    def __init__(self, c: VisionConfig, *, init: Init):
        self.self_attn = VisionAttention(c, init=init)
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps, init=init)
        self.mlp = VisionMLP(c, init=init)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps, init=init)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segments: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), rope, segments)
        return x + self.mlp(self.layer_norm2(x))


class VisionTower(nnx.Module):
    """The CLIP-like ViT: ``pixel_values [P, patch_dim]`` -> ``[P, hidden]`` (`vision_inputs` gives the rest)."""

    def __init__(self, config: VisionConfig, *, init: Init):
        self.config = config
        self.embeddings = PatchEmbedding(config, init=init)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps, init=init)
        self.layers = nnx.List([VisionEncoderLayer(config, init=init) for _ in range(config.num_hidden_layers)])

    def __call__(self, pixel_values: jax.Array, positions: jax.Array, segments: jax.Array) -> jax.Array:
        """``pixel_values [P, patch_dim]``, ``positions [P, 3]``, ``segments [P]`` -> ``[P, hidden]``."""
        c = self.config
        rope = vision_rope(positions, c.head_dim, c.rope_theta)
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x, rope, segments)
        return x


class MultiModalProjector(nnx.Module):
    """Vision width -> text width per patch, then ``merge ** 2`` consecutive patches -> one text token.

    ``[P, vision_hidden] -> [P / merge**2, text_hidden]``.
    """

    def __init__(self, config: VisionConfig, text_hidden: int, *, init: Init):
        c = config
        bias = c.projector_bias
        self.linear_1 = BiasLinear(c.hidden_size, c.projector_hidden_size, init=init, bias=bias)
        self.linear_2 = BiasLinear(c.projector_hidden_size, text_hidden, init=init, bias=bias)
        merged = text_hidden * c.spatial_merge_size**2
        self.merge_linear_1 = BiasLinear(merged, c.projector_hidden_size, init=init, bias=bias)
        self.merge_linear_2 = BiasLinear(c.projector_hidden_size, text_hidden, init=init, bias=bias)
        self.merge = c.spatial_merge_size

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.linear_2(gelu(self.linear_1(x)))
        h = h.reshape(h.shape[0] // self.merge**2, -1)
        return self.merge_linear_2(gelu(self.merge_linear_1(h)))
