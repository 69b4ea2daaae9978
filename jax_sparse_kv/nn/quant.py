"""Block-scaled fp8 weights: the formats, dequantization (host and in the matmul) and a quantizer.

Two formats, both ``weight [..., out, in]`` float8 with one scale per ``[b0, b1]``
block of its last two axes (``scale [..., ceil(out / b0), ceil(in / b1)]``):

- ``"fp8"`` (block fp8, DeepSeek-V3 / MiniMax-M2 releases): float32 factors,
  ``weight_block_size [b0, b1]`` (128 x 128 by default).
- ``"mxfp8"`` (OCP Microscaling v1.0, the MiniMax-M3-MXFP8 release): uint8 E8M0
  exponents ``v``, factor ``2 ** (v - 127)`` (255 is NaN), blocks ``[1, 32]``.

The real weight is ``weight * factor`` of its block. `MiniMaxM3.from_pretrained`
keeps such weights in that form in device memory (``weight_dtype="auto"``):
`jax_sparse_kv.nn.model.Linear` and ``Experts`` then hold the fp8 values and the
scales as parameters (``weight`` + ``weight_scale_inv``, ``gate_up_proj`` +
``gate_up_proj_scale_inv``, ...) and `dequantize` them inside the jitted step,
where XLA fuses the scaling into the matmul's operand (a decode step reads the
chosen experts' fp8 bytes only). The result equals dequantizing while loading,
bit for bit: the product is formed in float32 and cast to the activations'
dtype, as the loader does.

`quantize` is the other direction (host, vectorized): OCP MX's shared exponent
``floor(log2(amax)) - 8`` per 32 inputs for mxfp8; ``amax / 448`` per block for
fp8. `jax_sparse_kv.nn.params.quantize_weights` turns a float model's projection
and expert weights into resident fp8 with it (benchmarks and tests use it; real
checkpoints arrive quantized).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "BlockQuant",
    "MXFP8",
    "e8m0_to_float32",
    "dequantize_block_fp8",
    "scale_factors",
    "dequantize",
    "quantize",
    "quantize_mx_activations",
    "mxfp8_matmul",
]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
E4M3_EMAX = 8  # OCP MX v1.0, table 1: the largest power of two of e4m3 (448 = 1.75 * 2 ** 8)


@dataclasses.dataclass(frozen=True)
class BlockQuant:
    """How a weight's fp8 values are scaled: ``method`` ("fp8" or "mxfp8") and ``block (b0, b1)`` (static)."""

    method: str
    block: tuple[int, int]
    #: How a quantized `Linear` multiplies: ``"dequantize"`` (exact: the weight dequantized inside the step) or
    #: ``"mxfp8_dot"`` (mxfp8 only: activations quantized too, one block-scaled fp8 dot, `mxfp8_matmul`).
    dot: str = "dequantize"

    def __post_init__(self):
        if self.method not in ("fp8", "mxfp8"):
            raise ValueError(f"method must be 'fp8' or 'mxfp8', got {self.method!r}")
        if self.method == "mxfp8" and tuple(self.block) != (1, 32):
            raise ValueError(f"mxfp8 blocks are (1, 32), got {tuple(self.block)}")
        if self.dot not in ("dequantize", "mxfp8_dot") or (self.dot == "mxfp8_dot" and self.method != "mxfp8"):
            raise ValueError(f"dot must be 'dequantize' or (for mxfp8) 'mxfp8_dot', got {self.dot!r}")

    @property
    def scale_dtype(self) -> np.dtype:
        """uint8 E8M0 exponents (mxfp8) or float32 factors (fp8)."""
        return np.dtype(np.uint8) if self.method == "mxfp8" else np.dtype(np.float32)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a weight of ``shape [..., out, in]``."""
        *lead, out, inp = shape
        return (*lead, -(-out // self.block[0]), -(-inp // self.block[1]))


MXFP8 = BlockQuant("mxfp8", (1, 32))


# ---------------------------------------------------------------------- host (NumPy): loading


def e8m0_to_float32(exponents: np.ndarray) -> np.ndarray:
    """OCP MX E8M0 scales (uint8 ``v``) -> their factors ``2 ** (v - 127)`` as float32 (``v = 255`` is NaN).

    ``v = 0`` is ``2 ** -127``, a float32 subnormal, exactly representable.
    """
    v = np.asarray(exponents)
    if v.dtype != np.uint8:
        raise ValueError(f"E8M0 scales are uint8, got {v.dtype}")
    factors = np.ldexp(np.float32(1.0), np.minimum(v, 254).astype(np.int32) - 127).astype(np.float32)
    return np.where(v == 255, np.float32(np.nan), factors)


def dequantize_block_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``weight [..., out, in]`` float8 times its block's factor ``scale_inv [..., ceil(out/b0), ceil(in/b1)]``
    -> float32 (host).

    Element ``(i, j)`` is ``weight[i, j] * scale_inv[i // b0, j // b1]``; edge
    blocks may be partial. Vectorized over blocks (an MXFP8 expert has ~10^6 of
    them): the weight is viewed as ``[..., rows, b0, cols, b1]`` and multiplied by
    the factors broadcast over each block, with no full-size copy of the factors.
    """
    b0, b1 = block
    *lead, out_dim, in_dim = weight.shape
    scale = np.asarray(scale_inv, np.float32)
    rows, cols = scale.shape[-2:]
    if scale.shape != (*lead, -(-out_dim // b0), -(-in_dim // b1)):
        raise ValueError(f"scale_inv shape {scale.shape} does not cover weight {weight.shape} in blocks of {block}")
    out = np.zeros((*lead, rows * b0, cols * b1), np.float32)
    out[..., :out_dim, :in_dim] = weight
    view = out.reshape(*lead, rows, b0, cols, b1)
    view *= scale[..., :, None, :, None]
    return out[..., :out_dim, :in_dim] if out.shape != weight.shape else out


def quantize(weight: Any, quant: BlockQuant = MXFP8) -> tuple[np.ndarray, np.ndarray]:
    """``weight [..., out, in]`` (any float) -> ``(float8_e4m3fn values, scales)`` of `quant`'s format (host).

    mxfp8: per 32 inputs of a row, the shared exponent ``X = floor(log2(amax)) - 8`` (OCP MX v1.0, 6.3;
    ``-127`` for an all-zero block), stored as ``X + 127``; values ``w / 2 ** X`` saturated to +-448.
    fp8: per ``[b0, b1]`` block, the factor ``amax / 448`` (float32); values ``w / factor``.
    """
    w = np.asarray(weight, np.float32)
    *lead, out, inp = w.shape
    b0, b1 = quant.block
    rows, cols = -(-out // b0), -(-inp // b1)
    padded = np.zeros((*lead, rows * b0, cols * b1), np.float32)
    padded[..., :out, :inp] = w
    tiles = padded.reshape(*lead, rows, b0, cols, b1)
    amax = np.abs(tiles).max(axis=(-3, -1))  # [..., rows, cols]
    if quant.method == "mxfp8":
        _, e = np.frexp(amax)  # amax = m * 2 ** e, m in [0.5, 1): floor(log2(amax)) = e - 1
        x = np.where(amax > 0, e - 1 - E4M3_EMAX, -127).clip(-127, 127)
        scale = (x + 127).astype(np.uint8)
        factor = np.ldexp(np.float32(1.0), x).astype(np.float32)
    else:
        factor = (np.maximum(amax, 1e-12) / E4M3_MAX).astype(np.float32)
        scale = factor
    values = np.clip(tiles / factor[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
    values = values.reshape(padded.shape)[..., :out, :inp].astype(E4M3)
    return values, scale


# ---------------------------------------------------------------------- device (JAX): inside the step


def scale_factors(scale: jax.Array, quant: BlockQuant) -> jax.Array:
    """The float32 factor of each block: E8M0 ``2 ** (v - 127)`` (exact, by its bits) or the float32 as is."""
    if quant.method != "mxfp8":
        return scale.astype(jnp.float32)
    v = scale.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(jnp.clip(v, 1, 254).astype(jnp.uint32) << 23, jnp.float32)
    factors = jnp.where(v == 0, np.float32(2.0**-127), normal)
    return jnp.where(v == 255, np.float32(np.nan), factors)


def dequantize(weight: jax.Array, scale: jax.Array, quant: BlockQuant, dtype: Any) -> jax.Array:
    """``weight [..., out, in]`` fp8 and ``scale [..., ceil(out/b0), ceil(in/b1)]`` -> the real weight in `dtype`.

    Formed in float32 and cast, as the loader does (so equal to a dequantized-at-load weight); inside a
    jitted matmul XLA fuses it into the dot's operand.
    """
    b0, b1 = quant.block
    factors = scale_factors(scale, quant)
    *lead, out, inp = weight.shape
    rows, cols = factors.shape[-2:]
    w = weight.astype(jnp.float32)
    if (out, inp) == (rows * b0, cols * b1):
        w = w.reshape(*lead, rows, b0, cols, b1) * factors[..., :, None, :, None]
        return w.reshape(weight.shape).astype(dtype)
    factors = jnp.repeat(jnp.repeat(factors, b0, axis=-2), b1, axis=-1)[..., :out, :inp]
    return (w * factors).astype(dtype)


def quantize_mx_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., K]`` (K a multiple of 32) -> ``(float8_e4m3fn [..., K], float8_e8m0fnu [..., K / 32])``, OCP MX.

    The same rule as `quantize` (shared exponent ``floor(log2(amax)) - 8`` per 32 values, saturating), in JAX,
    for the activations of a block-scaled fp8 dot.
    """
    *lead, k = x.shape
    if k % 32:
        raise ValueError(f"MXFP8 activations need a multiple of 32 values on the contracting axis, got {k}")
    blocks = x.astype(jnp.float32).reshape(*lead, k // 32, 32)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    _, e = jnp.frexp(amax)
    exponent = jnp.clip(jnp.where(amax > 0, e - 1 - E4M3_EMAX, -127), -127, 127)
    # times 2 ** -X, not over 2 ** X: 2 ** -127 is a float32 subnormal, which XLA may flush to zero
    values = jnp.clip(blocks * jnp.ldexp(jnp.float32(1.0), -exponent)[..., None], -E4M3_MAX, E4M3_MAX)
    scales = jax.lax.bitcast_convert_type((exponent + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)
    return values.astype(jnp.float8_e4m3fn).reshape(x.shape), scales


def mxfp8_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., in] @ weight.T`` with both operands in MXFP8: one block-scaled fp8 dot (`jax.nn.scaled_matmul`).

    ``weight [out, in]`` float8_e4m3fn with ``scale [out, in / 32]`` uint8 E8M0 (the release's tensors, bit
    for bit: E8M0's bits are the exponent byte); ``x`` is quantized per 32 inputs on the fly. On GPUs with a
    block-scaled fp8 matmul (cuDNN, Blackwell) this is that matmul; elsewhere XLA expands it. Not exact
    against the dequantized weight (the activations are rounded to e4m3), unlike `dequantize`; XLA:CPU has
    no lowering for it, so on CPU it is checked by export only. Returns ``[..., out]`` in ``x.dtype``.
    """
    *lead, k = x.shape
    xq, xs = quantize_mx_activations(x.reshape(-1, k))
    ws = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu)
    y = jax.nn.scaled_matmul(xq[None], weight[None], xs[None], ws[None], preferred_element_type=jnp.float32)
    return y[0].reshape(*lead, weight.shape[0]).astype(x.dtype)
