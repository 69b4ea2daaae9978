"""Quantized MiniMax-M3 checkpoints for tests, written from the formats' definitions (independent of the loader).

Block fp8 (DeepSeek-V3 / MiniMax-M2 releases): per ``[b0, b1]`` block ``scale_inv = amax / 448`` and
``fp8 = weight / scale_inv``. MXFP8 (OCP MX v1.0, the MiniMax-M3-MXFP8 release): per 32 inputs of a row the
shared exponent ``floor(log2(amax)) - 8`` as E8M0. Both block by block, in plain loops.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from jax_sparse_kv.nn import MiniMaxM3
from jax_sparse_kv.nn.weights import SINGLE_FILE, save_pretrained

BLOCK = (32, 24)  # partial edge blocks in both directions for 64- and 16-wide tensors
QUANTIZED = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".w1.", ".w2.", ".w3.", "_proj.weight")
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def quantize_block(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    b0, b1 = block
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].astype(np.float32)
            scale[i, j] = max(np.abs(tile).max(), 1e-12) / E4M3_MAX
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def write_fp8_checkpoint(model: MiniMaxM3, path, block=BLOCK, config_block=BLOCK):
    """Saves `model` in the original spelling with its 2-D projections in block fp8.

    Returns ``(real values of the quantized tensors, every tensor as written)``
    (NumPy's safetensors loader cannot read float8 back).
    """
    save_pretrained(model, path, spelling="original")
    tensors = load_file(str(path / SINGLE_FILE))
    expected = {}
    for key in list(tensors):
        if tensors[key].ndim == 2 and any(m in key for m in QUANTIZED) and "embed" not in key:
            q, scale = quantize_block(tensors[key], block)
            tensors[key], tensors[key + "_scale_inv"] = q, scale
            expected[key] = reference_dequant(q, scale, block)
    save_file(tensors, str(path / SINGLE_FILE))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if config_block is not None:
        config["quantization_config"]["weight_block_size"] = list(config_block)
    (path / "config.json").write_text(json.dumps(config))
    return expected, tensors


def reference_dequant(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """Element by block index, written independently of the loader's row-block loop."""
    i = np.arange(q.shape[0])[:, None] // block[0]
    j = np.arange(q.shape[1])[None, :] // block[1]
    return q.astype(np.float32) * scale[i, j]


E4M3_EMAX = 8  # OCP MX v1.0, table 1: the largest power of two of float8_e4m3fn (448 = 1.75 * 2**8)


def quantize_mx(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP Microscaling (MX v1.0, section 6.3) MXFP8 E4M3, blocks of 32 along a row: the shared exponent is
    ``floor(log2(amax)) - emax_elem``, stored as E8M0 (``X + 127``); elements are ``w / 2**X`` cast to e4m3,
    saturating at +-448. Written from the spec, block by block, independently of the loader."""
    rows, cols = w.shape
    nblocks = -(-cols // 32)
    exps = np.zeros((rows, nblocks), np.uint8)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(rows):
        for b in range(nblocks):
            tile = w[r, b * 32 : (b + 1) * 32].astype(np.float32)
            amax = float(np.abs(tile).max())
            x = (int(np.floor(np.log2(amax))) - E4M3_EMAX) if amax > 0 else -127
            exps[r, b] = x + 127
            q[r, b * 32 : (b + 1) * 32] = np.clip(tile / np.float32(2.0**x), -E4M3_MAX, E4M3_MAX).astype(q.dtype)
    return q, exps


def write_mxfp8_checkpoint(model: MiniMaxM3, path, method="mxfp8", block=(1, 32)):
    """`model` in the original spelling, its 2-D projections in MXFP8; ``(real values of the quantized tensors,
    every tensor as written)``."""
    save_pretrained(model, path, spelling="original")
    tensors = load_file(str(path / SINGLE_FILE))
    expected = {}
    for key in list(tensors):
        if tensors[key].ndim == 2 and any(m in key for m in QUANTIZED) and "embed" not in key:
            q, exps = quantize_mx(tensors[key])
            tensors[key], tensors[key + "_scale_inv"] = q, exps
            # the real value: element times 2 ** (exponent - 127), the factor repeated over its 32 inputs
            factors = np.repeat(2.0 ** (exps.astype(np.float64) - 127), 32, axis=1)[:, : q.shape[1]]
            expected[key] = (q.astype(np.float64) * factors).astype(np.float32)
    save_file(tensors, str(path / SINGLE_FILE))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": method,
        "weight_block_size": list(block),
        "ignored_layers": ["lm_head", "model.embed_tokens"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return expected, tensors
