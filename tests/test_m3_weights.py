"""Loading and saving MiniMax-M3 checkpoints: spellings, dtypes, errors before anything loads, host memory."""

from __future__ import annotations

import json
import os
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_sparse_kv.nn import MiniMaxM3, tiny_config
from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.nn.weights import INDEX_FILE, checkpoint_pieces, save_pretrained

CONFIG = tiny_config("dsd", "dmd", num_local_experts=3, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def model():
    return MiniMaxM3(CONFIG, seed=3)


def params(m: MiniMaxM3) -> dict[str, np.ndarray]:
    return {k: np.asarray(v[...]) for k, v in hf_params(m).items()}


def logits(m: MiniMaxM3) -> np.ndarray:
    tokens = jnp.arange(24).reshape(2, 12) % CONFIG.vocab_size
    return np.asarray(m(tokens, jnp.broadcast_to(jnp.arange(12), (2, 12)))[0])


@pytest.mark.slow  # 6-8 s a case: save and load a model; test_m3_fixtures loads every spelling of the fixture
@pytest.mark.parametrize("spelling, shard_bytes", [("transformers", None), ("original", None), ("original", 40_000)])
def test_round_trip_in_every_spelling(model, tmp_path, spelling, shard_bytes):
    save_pretrained(model, tmp_path, spelling=spelling, max_shard_bytes=shard_bytes)
    if shard_bytes:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert len(set(index["weight_map"].values())) > 1
    if spelling == "original":
        keys = load_file(next(str(p) for p in tmp_path.glob("*.safetensors")))
        assert all(k.startswith("language_model.") for k in keys)
    loaded = MiniMaxM3.from_pretrained(tmp_path)
    assert loaded.config == CONFIG
    mine, theirs = params(model), params(loaded)
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)
    np.testing.assert_array_equal(logits(loaded), logits(model))


def test_original_names_map_to_transformers_names():
    c = CONFIG
    p = checkpoint_pieces("language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight", c)
    assert (p.target, p.index) == (
        "model.layers.1.mlp.experts.gate_up_proj",
        (2, slice(c.intermediate_size, 2 * c.intermediate_size)),
    )
    p = checkpoint_pieces("language_model.model.layers.1.block_sparse_moe.e_score_correction_bias", c)
    assert p.target == "model.layers.1.mlp.gate.e_score_correction_bias"
    p = checkpoint_pieces("language_model.model.layers.1.self_attn.index_q_proj.weight", c)
    assert p.target == "model.layers.1.self_attn.indexer.q_proj.weight"
    p = checkpoint_pieces("model.layers.0.mlp.up_proj.weight", c)
    assert (p.target, p.index) == (
        "model.layers.0.mlp.gate_up_proj.weight",
        (slice(c.dense_intermediate_size, 2 * c.dense_intermediate_size),),
    )
    assert checkpoint_pieces("language_model.lm_head.weight", c).target == "lm_head.weight"
    assert checkpoint_pieces("mtp.layers.0.eh_proj.weight", c) is None
    assert checkpoint_pieces("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", c) is None


def test_bf16_stays_bf16_unless_asked(model, tmp_path):
    bf16 = nnx.clone(model)
    for var in hf_params(bf16).values():
        if var[...].dtype == jnp.float32 and var[...].ndim > 1:
            var.set_value(var[...].astype(jnp.bfloat16))
    save_pretrained(bf16, tmp_path)
    loaded = MiniMaxM3.from_pretrained(tmp_path)
    assert hf_params(loaded)["model.layers.0.self_attn.q_proj.weight"][...].dtype == jnp.bfloat16
    as_f32 = MiniMaxM3.from_pretrained(tmp_path, dtype=jnp.float32)
    assert hf_params(as_f32)["model.layers.0.self_attn.q_proj.weight"][...].dtype == jnp.float32
    # the router's correction bias is a choice threshold: kept in f32 whatever the weights are
    assert hf_params(loaded)["model.layers.1.mlp.gate.e_score_correction_bias"][...].dtype == jnp.float32


def _rewrite(path, edit):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _load_counting(path):
    read = []
    try:
        MiniMaxM3.from_pretrained(path, on_tensor=lambda k, t: read.append(k))
    finally:
        assert read == [], "a tensor was read before the checkpoint was validated"


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.indexer.k_proj.weight"),
            r"missing tensors: \['model.layers.1.self_attn.indexer.k_proj.weight'\]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}),
            r"unexpected tensors \(not part of this model\): \['model.layers.0.self_attn.extra.weight'\]",
        ),
        (
            lambda t: t.update({"model.layers.2.self_attn.o_proj.weight": np.zeros((64, 32), np.float32)}),
            r"model.layers.2.self_attn.o_proj.weight: checkpoint shape \(64, 32\), model expects \(64, 64\)",
        ),
    ],
)
def test_checkpoint_errors_before_anything_loads(model, tmp_path, edit, match):
    save_pretrained(model, tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        _load_counting(tmp_path)


def test_a_missing_expert_piece_is_named(model, tmp_path):
    save_pretrained(model, tmp_path, spelling="original")
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    tensors.pop("language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight")
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.gate_up_proj \(only \[.*'expert 2 w1'"):
        _load_counting(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        MiniMaxM3.from_pretrained(tmp_path)


def test_host_memory_peaks_near_the_largest_tensor(tmp_path):
    """Tensors are read one at a time: the host peak is a few largest tensors, not the model."""
    config = tiny_config("dssss", "dmmmm", hidden_size=128, num_local_experts=4, intermediate_size=64)
    big = MiniMaxM3(config, seed=0)
    save_pretrained(big, tmp_path, spelling="original", max_shard_bytes=1 << 20)
    sizes = {k: v[...].nbytes for k, v in hf_params(big).items()}
    total, largest = sum(sizes.values()), max(sizes.values())
    assert total > 10 * largest  # the bound below is then meaningfully smaller than the model
    tracemalloc.start()
    try:
        MiniMaxM3.from_pretrained(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * largest + (1 << 20), (peak, largest, total)
