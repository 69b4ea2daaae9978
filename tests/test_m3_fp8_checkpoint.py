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
from safetensors.numpy import save_file
from support.fp8_checkpoints import (
    quantize_block,
    reference_dequant,
    write_fp8_checkpoint,
    write_mxfp8_checkpoint,
)

from jax_sparse_kv.nn import MiniMaxM3, tiny_config
from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.nn.weights import SINGLE_FILE, dequantize_block_fp8, save_pretrained

CONFIG = tiny_config("dsd", "dmd", num_local_experts=3, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def model():
    return MiniMaxM3(CONFIG, seed=4)


def _logits(m: MiniMaxM3) -> np.ndarray:
    tokens = jnp.arange(24).reshape(2, 12) % CONFIG.vocab_size
    return np.asarray(m(tokens, jnp.broadcast_to(jnp.arange(12), (2, 12)))[0])


def _assert_loaded_exactly(loaded: MiniMaxM3, expected: dict, expert: int) -> dict:
    """Pieces of each kind (one expert's w1/w3/w2, an attention and an indexer projection) hold exactly their
    checkpoint's dequantized values, wherever the name map put them; returns every loaded parameter."""
    got = {k: np.asarray(v[...]) for k, v in hf_params(loaded).items()}
    p = f"language_model.model.layers.1.block_sparse_moe.experts.{expert}."
    i = CONFIG.intermediate_size
    experts = got["model.layers.1.mlp.experts.gate_up_proj"][expert]
    np.testing.assert_array_equal(experts[:i], expected[p + "w1.weight"])
    np.testing.assert_array_equal(experts[i:], expected[p + "w3.weight"])
    np.testing.assert_array_equal(got["model.layers.1.mlp.experts.down_proj"][expert], expected[p + "w2.weight"])
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], expected[q])
    k = "language_model.model.layers.1.self_attn.index_k_proj.weight"
    np.testing.assert_array_equal(got["model.layers.1.self_attn.indexer.k_proj.weight"], expected[k])
    return got


@pytest.mark.slow  # ~26 s: writes and loads block-fp8 checkpoints
def test_block_fp8_checkpoint_loads_dequantized(model, tmp_path):
    expected, _ = write_fp8_checkpoint(model, tmp_path)
    assert len(expected) > 10  # attention, indexer, shared/dense MLPs and every expert piece
    loaded = MiniMaxM3.from_pretrained(tmp_path, weight_dtype=jnp.float32)  # dequantized while loading
    assert loaded.dtype == jnp.float32  # the unquantized tensors' dtype, not fp8
    # every quantized piece, wherever the name map put it, holds exactly fp8 * its block's scale
    got = _assert_loaded_exactly(loaded, expected, expert=2)
    # and the model is the original up to fp8 rounding of its weights
    # (per-token error relative to the largest logit; the median, since a rounded weight can flip one
    # token's MoE routing or indexer top-k with these sharp random weights, as bf16 cache rounding does)
    want, have = _logits(model), _logits(loaded)
    err = np.median(np.abs(have - want).max(axis=-1)) / np.abs(want).max()
    assert err < 1 / 16, err  # one e4m3 rounding step (3 mantissa bits); measured 0.035
    # each weight is its unquantized value to fp8 precision (e4m3: 3 mantissa bits, so <= 1/16 of its block's max)
    original = np.asarray(hf_params(model)["model.layers.0.self_attn.q_proj.weight"][...])
    assert np.abs(got["model.layers.0.self_attn.q_proj.weight"] - original).max() <= np.abs(original).max() / 16


@pytest.mark.slow  # 5-10 s: fp8 loading at the default block size
def test_default_block_is_128_and_bf16_loading(tmp_path):
    model = MiniMaxM3(CONFIG, seed=5)
    expected, _ = write_fp8_checkpoint(model, tmp_path, block=(128, 128), config_block=None)
    loaded = MiniMaxM3.from_pretrained(tmp_path, dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16)
    q = "language_model.model.layers.2.self_attn.o_proj.weight"
    got = np.asarray(hf_params(loaded)["model.layers.2.self_attn.o_proj.weight"][...])
    np.testing.assert_array_equal(got, expected[q].astype(jnp.bfloat16))


def test_dequantize_block_fp8_partial_blocks():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(70, 50)).astype(np.float32)
    q, scale = quantize_block(w, (32, 24))
    assert scale.shape == (3, 3)
    np.testing.assert_array_equal(dequantize_block_fp8(q, scale, (32, 24)), reference_dequant(q, scale, (32, 24)))
    assert np.abs(dequantize_block_fp8(q, scale, (32, 24)) - w).max() < 0.07 * np.abs(w).max()


def test_fp8_checkpoint_errors_name_the_tensor(model, tmp_path):
    _, tensors = write_fp8_checkpoint(model, tmp_path)
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
        load_with(
            **{key + "_scale_inv": scale, "language_model.model.norm.weight_scale_inv": np.ones((1, 1), np.float32)}
        )
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
    write_fp8_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is F8_E4M3 but config.json has no quantization_config"):
        MiniMaxM3.from_pretrained(tmp_path)


# ---------------------------------------------------------------------- MXFP8 (the MiniMax-M3-MXFP8 release's format)


def test_mxfp8_checkpoint_loads_its_exact_dequantization(model, tmp_path):
    expected, tensors = write_mxfp8_checkpoint(model, tmp_path)
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert tensors[q + "_scale_inv"].dtype == np.uint8 and tensors[q + "_scale_inv"].shape[1] == -(
        -CONFIG.hidden_size // 32
    )
    loaded = MiniMaxM3.from_pretrained(tmp_path, weight_dtype=jnp.float32)
    assert loaded.dtype == jnp.float32
    got = _assert_loaded_exactly(loaded, expected, expert=1)
    # unquantized (ignored) tensors as they were; quantized ones within one e4m3 step of the original
    original = {k: np.asarray(v[...]) for k, v in hf_params(model).items()}
    np.testing.assert_array_equal(got["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    w = original["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(got["model.layers.0.self_attn.q_proj.weight"] - w).max() <= np.abs(w).max() / 8


def test_e8m0_scales_are_powers_of_two():
    from jax_sparse_kv.nn.weights import e8m0_to_float32

    v = np.array([[0, 1, 126, 127, 128, 254, 255]], np.uint8)
    got = e8m0_to_float32(v)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[0, :6], np.float32([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]))
    assert np.isnan(got[0, 6])
    with pytest.raises(ValueError, match="E8M0 scales are uint8, got float32"):
        e8m0_to_float32(np.ones((1, 1), np.float32))


def test_mxfp8_dequantization_is_vectorized_and_exact():
    """A real-sized expert row block (6144 x 3072 has ~600K MX blocks) dequantizes without a per-block loop: exact
    against the element-wise definition."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(96, 3072)).astype(ml_dtypes.float8_e4m3fn)
    exps = rng.integers(110, 140, size=(96, 96)).astype(np.uint8)
    from jax_sparse_kv.nn.weights import e8m0_to_float32

    got = dequantize_block_fp8(q, e8m0_to_float32(exps), (1, 32))
    np.testing.assert_array_equal(got, reference_dequant(q, e8m0_to_float32(exps), (1, 32)))


def test_mislabelled_or_misshaped_scales_are_named(model, tmp_path):
    """The MXFP8 layout declared as block fp8 (uint8 scales read as factors: weights ~6.5e5x too large before)."""
    _, tensors = write_mxfp8_checkpoint(model, tmp_path, method="fp8", block=(1, 32))
    key = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=rf"{key} is U8; quant_method 'fp8' scales are F32 \(float32 factors\)"):
        MiniMaxM3.from_pretrained(tmp_path)
    # MXFP8 declared, float32 factors stored
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "mxfp8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, key: tensors[key].astype(np.float32)}, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=rf"{key} is F32; quant_method 'mxfp8' scales are U8 \(uint8 E8M0 exponents\)"):
        MiniMaxM3.from_pretrained(tmp_path)
    # a scale of the wrong shape, a weight without its scale
    save_file({**tensors, key: tensors[key][:, :1]}, str(tmp_path / SINGLE_FILE))
    with pytest.raises(
        ValueError, match=rf"{key}: shape \(\d+, 1\), expected \(\d+, 2\) for .* in blocks of \(1, 32\)"
    ):
        MiniMaxM3.from_pretrained(tmp_path)
    rest = {k: v for k, v in tensors.items() if k != key}
    save_file(rest, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=rf"q_proj.weight is F8_E4M3 without {key}"):
        MiniMaxM3.from_pretrained(tmp_path)
    # MXFP8 has one block size
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_method 'mxfp8' has weight_block_size \[1, 32\].*got \[128, 128\]"):
        MiniMaxM3.from_pretrained(tmp_path)
