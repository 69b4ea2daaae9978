"""Quantized weights kept quantized in device memory (``weight_dtype="auto"``, the default).

Checkpoints written by tests/support/fp8_checkpoints.py (quantizers from the formats' definitions): MXFP8 (the
MiniMax-M3-MXFP8 release's format) and block fp8 with blocks that divide every projection. The resident model
holds fp8 values and their scales and dequantizes inside the matmul; it must give the logits and greedy tokens
of the same checkpoint dequantized while loading, through the model, `make_step` and the serving engine, and
take the bytes the format says.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from support.common import model_call
from support.fp8_checkpoints import quantize_block, quantize_mx, write_fp8_checkpoint, write_mxfp8_checkpoint
from support.serving_reference import one_bucket

import jax_sparse_kv as jsk
from jax_sparse_kv import serving
from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.nn.params import hf_params, quantizable_params, quantize_param, quantize_weights, set_quantized_dot
from jax_sparse_kv.nn.quant import MXFP8, BlockQuant, dequantize, quantize
from jax_sparse_kv.nn.weights import SINGLE_FILE, save_pretrained

CONFIG = tiny_config("dsd", "dmd", num_local_experts=4, num_experts_per_tok=2)
FP8_BLOCK = (16, 16)  # divides every projection and the gate/up halves (experts 32, dense 96): all resident
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


# fp8 (block-scaled) in the slow run (~10 s); mxfp8, the release's format, and the fp8 quantizer tests stay
@pytest.fixture(scope="module", params=["mxfp8", pytest.param("fp8", marks=pytest.mark.slow)])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = MiniMaxM3(CONFIG, seed=7)
    if request.param == "mxfp8":
        write_mxfp8_checkpoint(model, path)
        quant = MXFP8
    else:
        write_fp8_checkpoint(model, path, block=FP8_BLOCK, config_block=FP8_BLOCK)
        quant = BlockQuant("fp8", FP8_BLOCK)
    resident = MiniMaxM3.from_pretrained(path)  # weight_dtype="auto"
    dequantized = MiniMaxM3.from_pretrained(path, weight_dtype=jnp.float32)
    return path, quant, resident, dequantized


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_resident_parameters_are_fp8_with_their_scales(checkpoint):
    _, quant, resident, dequantized = checkpoint
    params, plain = hf_params(resident), hf_params(dequantized)
    scale_dtype = np.uint8 if quant.method == "mxfp8" else np.float32
    quantized = [n for n in plain if n.endswith(("_proj.weight", "gate_up_proj", "down_proj")) and "lm_head" not in n]
    assert len(quantized) == 3 * 4 + 2 + 2 * 2 + 2 * 2  # attention, indexer q/k, dense MLPs, shared + experts
    for name in quantized:
        values, scale = params[name][...], params[name + "_scale_inv"][...]
        assert values.dtype == E4M3 and scale.dtype == scale_dtype, name
        assert scale.shape == quant.scale_shape(values.shape), name
        # the resident weight, dequantized as the matmul does, is the load-time dequantization exactly
        np.testing.assert_array_equal(np.asarray(dequantize(values, scale, quant, jnp.float32)), plain[name][...])
    experts = params["model.layers.1.mlp.experts.gate_up_proj_scale_inv"][...]
    assert experts.shape == (4, 2 * CONFIG.intermediate_size // quant.block[0], CONFIG.hidden_size // quant.block[1])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert params[name][...].dtype == jnp.float32 and name + "_scale_inv" not in params  # unquantized as stored


def test_weight_bytes_are_the_checkpoints_bytes(checkpoint):
    """Every tensor the model reads is held as stored: the resident model takes the checkpoint's bytes."""
    path, quant, resident, dequantized = checkpoint
    with safe_open(str(path / SINGLE_FILE), framework="numpy") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    width = {"F32": 4, "F8_E4M3": 1, "U8": 1}
    on_disk = sum(int(np.prod(s)) * width[dtypes[k]] for k, s in sizes.items())
    assert resident.weight_bytes() == on_disk
    # against the dequantized model: each quantized weight takes 1 byte a value + its scales instead of 4
    params = hf_params(resident)
    scales = [n for n in params if n.endswith("_scale_inv")]
    saved = sum(3 * params[n[: -len("_scale_inv")]][...].size - params[n][...].nbytes for n in scales)
    assert len(scales) == 22 and dequantized.weight_bytes() - resident.weight_bytes() == saved


def _logits(model, tokens, positions):
    """The model's cache-free logits, jitted (`support.common.model_call`: eagerly, hundreds of one-op programs)."""
    return model_call(model, tokens, positions)[0]


def test_logits_and_greedy_tokens_equal_the_dequantized_checkpoints(checkpoint):
    _, _, resident, dequantized = checkpoint
    tokens = jnp.arange(40).reshape(2, 20) * 7 % CONFIG.vocab_size
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    want = _logits(dequantized, tokens, positions)
    assert _rel(_logits(resident, tokens, positions), want) <= 1e-4  # prefill: the grouped (ragged) expert path
    one = (tokens[:, :1], positions[:, :1])
    assert _rel(_logits(resident, *one), _logits(dequantized, *one)) <= 1e-4  # one token: the chosen-experts path
    prompts = [list(range(3, 20)), list(range(40, 51))]
    table = jnp.asarray(np.arange(1, 13).reshape(2, 6), jnp.int32)
    runs = []
    for model in (resident, dequantized):
        layout = CONFIG.layout(num_slots=13 * 8, page_size=8, dtype=jnp.float32)
        runs.append(DecodeSession(make_step(model), jsk.SparseKVCache.zeros(layout), table).generate(prompts, 8))
    (tokens_r, logits_r), (tokens_d, logits_d) = runs
    np.testing.assert_array_equal(tokens_r, tokens_d)
    assert max(_rel(a, b) for a, b in zip(logits_r, logits_d, strict=True)) <= 1e-4


@pytest.mark.slow  # engines on fp8 weights; the default run checks the model's logits and tokens on them
def test_engine_on_resident_weights_gives_the_dequantized_tokens(checkpoint):
    _, _, resident, dequantized = checkpoint
    prompts = [list(range(1, 1 + n)) for n in (3, 9, 17, 30)]
    outs = []
    for model in (resident, dequantized):
        engine = serving.Engine(
            model,
            num_pages=48,
            page_size=8,
            dtype=jnp.float32,
            max_model_len=96,
            **one_bucket(dict(max_seqs=4, max_tokens_per_step=16)),
        )
        outs.append([o.token_ids for o in engine.generate(prompts, serving.SamplingParams(max_tokens=10))])
    assert outs[0] == outs[1]


@pytest.mark.slow  # ~8 s: a fallback variant of the resident-weight tests that stay
def test_misaligned_halves_are_dequantized_the_rest_stays_fp8(tmp_path):
    """Blocks of 24 rows split the fused gate/up halves (32 rows each): those load dequantized, the others stay."""
    write_fp8_checkpoint(MiniMaxM3(CONFIG, seed=7), tmp_path, block=(24, 16), config_block=(24, 16))
    resident = MiniMaxM3.from_pretrained(tmp_path)
    params = hf_params(resident)
    assert params["model.layers.0.self_attn.q_proj.weight"][...].dtype == E4M3  # 64 x 64 in blocks of 24: edges
    assert params["model.layers.1.mlp.experts.gate_up_proj"][...].dtype == jnp.float32
    assert params["model.layers.1.mlp.experts.down_proj"][...].dtype == jnp.float32  # both stacks or neither
    assert "model.layers.1.mlp.experts.down_proj_scale_inv" not in params
    dequantized = MiniMaxM3.from_pretrained(tmp_path, weight_dtype=jnp.float32)
    tokens = jnp.arange(24).reshape(2, 12) % CONFIG.vocab_size
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    assert _rel(resident(tokens, positions)[0], dequantized(tokens, positions)[0]) <= 1e-4


def test_bf16_dequantized_loading_and_bad_weight_dtype(checkpoint):
    path, _, resident, _ = checkpoint
    bf16 = MiniMaxM3.from_pretrained(path, dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16)
    assert hf_params(bf16)["model.layers.0.self_attn.q_proj.weight"][...].dtype == jnp.bfloat16
    auto_bf16 = MiniMaxM3.from_pretrained(path, dtype=jnp.bfloat16)
    params = hf_params(auto_bf16)
    assert params["model.layers.0.self_attn.q_proj.weight"][...].dtype == E4M3
    assert params["model.embed_tokens.weight"][...].dtype == jnp.bfloat16
    for bad in (jnp.int8, "fp8", None, jnp.float8_e4m3fn):
        with pytest.raises(ValueError, match=r"weight_dtype must be .auto. or a float dtype \(bfloat16"):
            MiniMaxM3.from_pretrained(path, weight_dtype=bad)


@pytest.mark.parametrize("quant", [MXFP8, BlockQuant("fp8", (16, 24)), BlockQuant("fp8", (128, 128))])
def test_library_quantizer_equals_the_definitions(quant):
    """`nn.quant.quantize` (vectorized) gives the block-by-block quantizers' values and scales exactly, partial
    edge blocks, an all-zero block and large and tiny magnitudes included."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(70, 100)).astype(np.float32) * np.exp2(rng.integers(-20, 20, size=(70, 1)))
    w[:16, :32] = 0.0
    values, scale = quantize(w, quant)
    want_values, want_scale = quantize_mx(w) if quant.method == "mxfp8" else quantize_block(w, quant.block)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
    stacked, stacked_scale = quantize(np.stack([w, -w]), quant)  # leading (expert) axes
    np.testing.assert_array_equal(stacked[0].view(np.uint8), values.view(np.uint8))
    np.testing.assert_array_equal(stacked_scale[1], scale)


@pytest.mark.parametrize("spelling", ["transformers", "original"])
def test_quantize_weights_in_place_and_save_load_round_trip(tmp_path, spelling):
    """A float model quantized in memory (`MiniMaxM3.quantize_weights`) equals its dequantized self; saved, it
    loads back resident with the same parameters."""
    model = quantize_weights(MiniMaxM3(CONFIG, seed=9), MXFP8)
    assert hf_params(model)["model.layers.2.self_attn.o_proj.weight"][...].dtype == E4M3
    assert hf_params(model)["lm_head.weight"][...].dtype == jnp.float32  # releases keep the head unquantized
    save_pretrained(model, tmp_path, spelling=spelling)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    loaded = MiniMaxM3.from_pretrained(tmp_path)
    for name, var in hf_params(model).items():
        got = hf_params(loaded)[name][...]
        assert got.dtype == var[...].dtype, name
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(var[...]).view(np.uint8))
    tokens = jnp.arange(24).reshape(2, 12) % CONFIG.vocab_size
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    np.testing.assert_array_equal(
        np.asarray(_logits(loaded, tokens, positions)), np.asarray(_logits(model, tokens, positions))
    )


def test_quantize_param_checks_shapes():
    model = MiniMaxM3(CONFIG, seed=1)
    values, scale = quantize(np.ones((64, 64), np.float32), MXFP8)
    with pytest.raises(ValueError, match="model.norm.weight is not a quantizable parameter"):
        quantize_param(model, "model.norm.weight", MXFP8, values, scale)
    with pytest.raises(ValueError, match=r"expected scale \(64, 2\) uint8"):
        quantize_param(model, "model.layers.0.self_attn.q_proj.weight", MXFP8, values, scale[:, :1])


def test_mx_activation_quantizer_equals_the_definition():
    from jax_sparse_kv.nn.quant import quantize_mx_activations

    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 96)).astype(np.float32) * np.exp2(rng.integers(-12, 12, size=(6, 1)))
    x[0, :32] = 0.0
    values, scales = quantize_mx_activations(jnp.asarray(x))
    want_values, want_exponents = quantize_mx(x)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_values.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)), want_exponents)
    with pytest.raises(ValueError, match="multiple of 32 values"):
        quantize_mx_activations(jnp.ones((2, 40)))


def test_mxfp8_dot_step_exports_for_cuda_as_a_block_scaled_fp8_dot():
    """With ``set_quantized_dot("mxfp8_dot")`` the step's projections are block-scaled fp8 dots (fp8 operands,
    E8M0 scales) in the program exported for cuda; XLA:CPU has no lowering for them, so this is checked by
    export (the default, exact path is what runs here)."""
    import re

    from jax import export

    model = set_quantized_dot(quantize_weights(MiniMaxM3(CONFIG, seed=2, dtype=jnp.bfloat16), MXFP8), "mxfp8_dot")
    step = make_step(model)
    layout = CONFIG.layout(num_slots=8 * 8, page_size=8, dtype=jnp.bfloat16)
    args = (
        step.params,
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        jsk.SparseKVCache.abstract(layout),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
    )
    target = "__op$block_scaled_dot"
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (target, "__gpu$xla.gpu.triton")]
    text = export.export(step.fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    calls = re.findall(rf"custom_call @{re.escape(target)}\((.*)\n", text)
    # (the exporter outlines one function per shape: count the weight shapes the calls take, as [1, out, in])
    operands = r"tensor<\d+x\d+x\d+xf8E4M3FN>, tensor<1x(\d+)x(\d+)xf8E4M3FN>"
    rhs = {tuple(map(int, m)) for c in calls for m in re.findall(operands, c)}
    params = hf_params(model)
    linear = [n for n in quantizable_params(model) if n.endswith(".weight") and "lm_head" not in n]
    want = {tuple(params[n][...].shape) for n in linear}
    assert rhs == want and len(want) >= 6, (rhs, want)  # attention, indexer, dense and shared MLP projections
    assert all("f8E8M0FNU" in c for c in calls), calls[0]
    with pytest.raises(ValueError, match="dot must be 'dequantize' or"):
        BlockQuant("fp8", (128, 128), dot="mxfp8_dot")
