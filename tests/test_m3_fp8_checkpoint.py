"""Block-fp8 MiniMax-M3 checkpoints (``quant_method: fp8`` + ``weight_scale_inv``), as MiniMax and DeepSeek release them.

A random model is saved in the original release's spelling, then its
projection and expert weights are quantized the way those releases are: per
``[b0, b1]`` block, ``scale_inv = amax / 448`` and ``fp8 = weight / scale_inv``
rounded to float8_e4m3fn. Loading must give back ``fp8 * scale_inv`` exactly,
and a model close to the unquantized one.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_sparse_kv.nn import MiniMaxM3, tiny_config
from jax_sparse_kv.nn.weights import SINGLE_FILE, dequantize_block_fp8, save_pretrained

CONFIG = tiny_config("dsd", "dmd", num_local_experts=3, num_experts_per_tok=2)
BLOCK = (32, 24)  # partial edge blocks in both directions for 64- and 16-wide tensors
QUANTIZED = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".w1.", ".w2.", ".w3.", "_proj.weight")
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def _quantize(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
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


def _write_fp8_checkpoint(model: MiniMaxM3, path, block=BLOCK, config_block=BLOCK):
    """Saves `model` in the original spelling with its 2-D projections in block fp8.

    Returns ``(real values of the quantized tensors, every tensor as written)``
    (NumPy's safetensors loader cannot read float8 back).
    """
    save_pretrained(model, path, spelling="original")
    tensors = load_file(str(path / SINGLE_FILE))
    expected = {}
    for key in list(tensors):
        if tensors[key].ndim == 2 and any(m in key for m in QUANTIZED) and "embed" not in key:
            q, scale = _quantize(tensors[key], block)
            tensors[key], tensors[key + "_scale_inv"] = q, scale
            expected[key] = _reference_dequant(q, scale, block)
    save_file(tensors, str(path / SINGLE_FILE))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if config_block is not None:
        config["quantization_config"]["weight_block_size"] = list(config_block)
    (path / "config.json").write_text(json.dumps(config))
    return expected, tensors


def _reference_dequant(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """Element by block index, written independently of the loader's row-block loop."""
    i = np.arange(q.shape[0])[:, None] // block[0]
    j = np.arange(q.shape[1])[None, :] // block[1]
    return q.astype(np.float32) * scale[i, j]


@pytest.fixture(scope="module")
def model():
    return MiniMaxM3(CONFIG, seed=4)


def _logits(m: MiniMaxM3) -> np.ndarray:
    tokens = jnp.arange(24).reshape(2, 12) % CONFIG.vocab_size
    return np.asarray(m(tokens, jnp.broadcast_to(jnp.arange(12), (2, 12)))[0])


def test_block_fp8_checkpoint_loads_dequantized(model, tmp_path):
    expected, _ = _write_fp8_checkpoint(model, tmp_path)
    assert len(expected) > 10  # attention, indexer, shared/dense MLPs and every expert piece
    loaded = MiniMaxM3.from_pretrained(tmp_path)
    assert loaded.dtype == jnp.float32  # the unquantized tensors' dtype, not fp8
    got = {k: np.asarray(v[...]) for k, v in loaded.hf_params().items()}
    # every quantized piece, wherever the name map put it, holds exactly fp8 * its block's scale
    p = "language_model.model.layers.1.block_sparse_moe.experts.2."
    i = CONFIG.intermediate_size
    experts = got["model.layers.1.mlp.experts.gate_up_proj"][2]
    np.testing.assert_array_equal(experts[:i], expected[p + "w1.weight"])
    np.testing.assert_array_equal(experts[i:], expected[p + "w3.weight"])
    np.testing.assert_array_equal(got["model.layers.1.mlp.experts.down_proj"][2], expected[p + "w2.weight"])
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], expected[q])
    k = "language_model.model.layers.1.self_attn.index_k_proj.weight"
    np.testing.assert_array_equal(got["model.layers.1.self_attn.indexer.k_proj.weight"], expected[k])
    # and the model is the original up to fp8 rounding of its weights
    # (per-token error relative to the largest logit; the median, since a rounded weight can flip one
    # token's MoE routing or indexer top-k with these sharp random weights, as bf16 cache rounding does)
    want, have = _logits(model), _logits(loaded)
    err = np.median(np.abs(have - want).max(axis=-1)) / np.abs(want).max()
    assert err < 1 / 16, err  # one e4m3 rounding step (3 mantissa bits); measured 0.035
    # each weight is its unquantized value to fp8 precision (e4m3: 3 mantissa bits, so <= 1/16 of its block's max)
    original = np.asarray(model.hf_params()["model.layers.0.self_attn.q_proj.weight"][...])
    assert np.abs(got["model.layers.0.self_attn.q_proj.weight"] - original).max() <= np.abs(original).max() / 16


def test_default_block_is_128_and_bf16_loading(tmp_path):
    model = MiniMaxM3(CONFIG, seed=5)
    expected, _ = _write_fp8_checkpoint(model, tmp_path, block=(128, 128), config_block=None)
    loaded = MiniMaxM3.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    q = "language_model.model.layers.2.self_attn.o_proj.weight"
    got = np.asarray(loaded.hf_params()["model.layers.2.self_attn.o_proj.weight"][...])
    np.testing.assert_array_equal(got, expected[q].astype(jnp.bfloat16))


def test_dequantize_block_fp8_partial_blocks():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(70, 50)).astype(np.float32)
    q, scale = _quantize(w, (32, 24))
    assert scale.shape == (3, 3)
    np.testing.assert_array_equal(dequantize_block_fp8(q, scale, (32, 24)), _reference_dequant(q, scale, (32, 24)))
    assert np.abs(dequantize_block_fp8(q, scale, (32, 24)) - w).max() < 0.07 * np.abs(w).max()


def test_fp8_checkpoint_errors_name_the_tensor(model, tmp_path):
    _, tensors = _write_fp8_checkpoint(model, tmp_path)
    key = "language_model.model.layers.0.self_attn.q_proj.weight"
    scale = tensors.pop(key + "_scale_inv")

    def load_with(**changes):
        save_file({**tensors, **changes}, str(tmp_path / SINGLE_FILE))
        MiniMaxM3.from_pretrained(tmp_path)

    with pytest.raises(ValueError, match=rf"{key} is F8_E4M3 without {key}_scale_inv"):
        load_with()
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv: shape \(1, 3\), expected \(2, 3\)"):
        load_with(**{key + "_scale_inv": scale[:1]})
    with pytest.raises(ValueError, match=r"norm.weight_scale_inv belongs to .*norm.weight, which is F32, not float8"):
        load_with(**{key + "_scale_inv": scale, "language_model.model.norm.weight_scale_inv": np.ones((1, 1), np.float32)})
    with pytest.raises(ValueError, match=r"layers.9.self_attn.q_proj.weight_scale_inv has no .*layers.9"):
        load_with(**{key + "_scale_inv": scale, key.replace(".0.", ".9.") + "_scale_inv": scale})


def test_unsupported_quantization_is_refused(model, tmp_path):
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        MiniMaxM3.from_pretrained(tmp_path)


def test_fp8_tensor_without_quantization_config_is_refused(model, tmp_path):
    _write_fp8_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is F8_E4M3 but config.json has no quantization_config"):
        MiniMaxM3.from_pretrained(tmp_path)
