"""Shape checks and the XLA glue shared by the GPU and TPU decode kernels.

A kernel computes, per (sequence, selection head, split), an unnormalised
flash-attention partial ``(o, m, den)`` over its chunks; the glue here groups the
queries before and merges the splits after. Scales are folded outside the
kernel: ``k_scale * softmax_scale`` into q, ``v_scale`` into the output, so a
kernel reads stored values as they are.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_decode_args", "as_pool", "group_queries", "merge_splits", "MASK_VALUE"]

#: A finite "minus infinity": exp(MASK_VALUE - m) is 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_decode_args(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    selected_blocks: jax.Array | None = None,
) -> None:
    """Raises `ValueError` (while tracing) naming the mismatched shapes."""
    if q.ndim != 3 or k_pages.ndim != 3 or v_pages.ndim != 3:
        raise ValueError(f"q, k_pages, v_pages must be 3-D, got {q.shape}, {k_pages.shape}, {v_pages.shape}")
    batch, num_q_heads, head_dim = q.shape
    if k_pages.shape[:2] != v_pages.shape[:2] or k_pages.shape[2] != head_dim:
        raise ValueError(f"k_pages {k_pages.shape} / v_pages {v_pages.shape} do not match q {q.shape}")
    kv_heads = k_pages.shape[1]
    if num_q_heads % kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of kv_heads={kv_heads}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} do not match batch={batch}")
    if selected_blocks is not None:
        if selected_blocks.ndim != 3 or selected_blocks.shape[0] != batch:
            raise ValueError(f"selected_blocks must be [batch, sel_heads, topk], got {selected_blocks.shape}")
        sel_heads = selected_blocks.shape[1]
        if sel_heads % kv_heads or num_q_heads % sel_heads:
            raise ValueError(
                f"sel_heads={sel_heads} must be a multiple of kv_heads={kv_heads} and divide num_q_heads={num_q_heads}"
            )


def as_pool(pages: jax.Array, dtype: Any) -> jax.Array:
    """Pool values of `dtype`: storage integers (``uint8/16/32``) are bitcast, free under jit.

    ``dtype=None`` keeps `pages` as they are (already the pool dtype).
    """
    if dtype is None or pages.dtype == np.dtype(dtype):
        return pages
    return jax.lax.bitcast_convert_type(pages, np.dtype(dtype))


def group_queries(
    q: jax.Array,
    groups: int,
    pad_to: int,
    *,
    k_scale: jax.Array | float,
    softmax_scale: float | None,
) -> jax.Array:
    """``[batch, num_q_heads, head_dim]`` -> ``[batch, groups, padded, head_dim]`` f32.

    Query head ``h`` goes to group ``h // (num_q_heads // groups)``; each group
    is zero-padded to a multiple of `pad_to` rows (kernels need aligned
    matmul operands). ``softmax_scale * k_scale`` is folded in.
    """
    batch, num_q_heads, head_dim = q.shape
    size = num_q_heads // groups
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qg = q.astype(jnp.float32).reshape(batch, groups, size, head_dim)
    qg = qg * (jnp.asarray(k_scale, jnp.float32) * scale)
    padded = math.ceil(size / pad_to) * pad_to
    return jnp.pad(qg, [(0, 0), (0, 0), (0, padded - size), (0, 0)])


def merge_splits(
    o: jax.Array, m: jax.Array, den: jax.Array, *, num_q_heads: int, v_scale: jax.Array | float
) -> jax.Array:
    """Merges flash partials over splits and un-groups the heads.

    Args:
      o: ``[batch, groups, splits, padded, v_dim]`` f32 unnormalised outputs.
      m, den: ``[batch, groups, splits, padded]`` f32 running max and sum.
      num_q_heads: static.
      v_scale: multiplies the result (V is read as stored).

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32; zeros where no token was read.
    """
    batch, groups, _, _, v_dim = o.shape
    peak = jnp.max(m, axis=2, keepdims=True)
    corr = jnp.exp(m - peak)
    total = jnp.sum(den * corr, axis=2)
    out = jnp.sum(o * corr[..., None], axis=2) / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
    out = out[:, :, : num_q_heads // groups].reshape(batch, num_q_heads, v_dim)
    return out * jnp.asarray(v_scale, jnp.float32)
