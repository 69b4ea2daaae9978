"""SparseKVLayout: validation, groups, stages, hashing and from_hf_config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.common import small_layout

import jax_sparse_kv as jsk
from jax_sparse_kv.errors import LayoutError


def test_groups_and_rows():
    layout = small_layout()
    assert layout.num_rows == 32 + 8
    assert layout.layer_ids == tuple(range(9))
    assert layout.index_kv_layer_ids == (6, 7, 8)
    assert layout.local_k_only_layer_ids == (3, 4, 5)
    assert layout.v_head_dim == 6
    assert layout.index_dtype == np.dtype(jnp.float32)
    assert layout.start_layer == 0 and layout.end_layer == 9


def test_layout_is_hashable_static_and_normalized():
    a = small_layout(dense_layer_ids=[2, 1, 0])
    b = small_layout(index_dtype=jnp.float32, start_layer=0, end_layer=9)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses_frozen_error()):
        a.num_slots = 8

    @jax.jit
    def rows(x, layout=a):
        return x + layout.num_rows

    assert int(rows(0)) == 40
    # usable as a static argument
    f = jax.jit(lambda layout, x: x * layout.page_size, static_argnums=0)
    assert int(f(a, 2)) == 16


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dense_layer_ids=(0, 1, 3)), r"both dense and sparse; offending ids: \[3\]"),
        (dict(dense_layer_ids=(0, -1)), r"non-negative; offending ids: \[-1\]"),
        (dict(sparse_layer_ids=(3, 4, 4, 5, 6, 7, 8)), r"duplicate ids: \[4\]"),
        (dict(k_only_layer_ids=(3, 1, 9)), r"subset of sparse_layer_ids; offending ids: \[1, 9\]"),
        (dict(num_slots=30), r"num_slots=30 must be a multiple of page_size=8"),
        (dict(num_slots=0), r"num_slots must be a positive int"),
        (dict(page_size=-8), r"page_size must be a positive int"),
        (dict(head_num=0), r"head_num must be a positive int"),
        (dict(head_dim=2.5), r"head_dim must be a positive int"),
        (dict(index_head_dim=0), r"index_head_dim must be a positive int"),
        (dict(v_head_dim=0), r"v_head_dim must be a positive int"),
        (dict(dtype=jnp.int8), r"dtype=int8 is not supported"),
        (dict(index_dtype="float64"), r"index_dtype=float64 is not supported"),
        (dict(start_layer=5, end_layer=5), r"end_layer=5 must be greater than start_layer=5"),
        (dict(start_layer=-1), r"start_layer must be a non-negative int"),
        (dict(dense_layer_ids=(), sparse_layer_ids=(), k_only_layer_ids=()), r"at least one attention layer"),
        (dict(dense_layer_ids=(0, "1")), r"must hold ints; offending ids: \['1'\]"),
        (dict(dense_layer_ids=5), r"must be a sequence of ints"),
    ],
)
def test_invalid_layouts_raise_layout_error(overrides, match):
    with pytest.raises(LayoutError, match=match):
        small_layout(**overrides)


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_pipeline_stage_locals():
    layout = small_layout(start_layer=2, end_layer=7)
    assert layout.local_layer_ids == (2, 3, 4, 5, 6)
    assert layout.local_dense_layer_ids == (2,)
    assert layout.local_k_only_layer_ids == (3, 4, 5)
    assert layout.local_index_kv_layer_ids == (6,)
    assert layout.main_index(2) == 0 and layout.main_index(6) == 4
    assert layout.index_kv_index(6) == 0


def test_bytes_per_token_mixed_dtypes():
    layout = small_layout(dtype=jnp.float8_e4m3fn, index_dtype=jnp.bfloat16)
    bpt = layout.bytes_per_token()
    assert bpt == {
        "k": 9 * 2 * 8 * 1,
        "v": 9 * 2 * 6 * 1,
        "index_k": 3 * 4 * 2,
        "index_kv_k": 3 * 4 * 2,
        "index_kv_v": 3 * 4 * 2,
    }


def minimax_config(num_layers=6, **sparse):
    cfg = {
        "sparse_index_dim": 16,
        "sparse_attention_freq": [0, 0] + [1] * (num_layers - 2),
        "sparse_disable_index_value": [0, 0, 1, 1] + [0] * (num_layers - 4),
    }
    cfg.update(sparse)
    return {
        "num_hidden_layers": num_layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "head_dim": 32,
        "sparse_attention_config": cfg,
    }


def test_from_hf_config():
    layout = jsk.SparseKVLayout.from_hf_config(minimax_config(), num_slots=64, page_size=16, dtype=jnp.bfloat16)
    assert layout.dense_layer_ids == (0, 1)
    assert layout.sparse_layer_ids == (2, 3, 4, 5)
    assert layout.k_only_layer_ids == (2, 3)
    assert layout.index_kv_layer_ids == (4, 5)
    assert (layout.head_num, layout.head_dim, layout.index_head_dim) == (2, 32, 16)
    assert layout.dtype == np.dtype(jnp.bfloat16)


def test_from_hf_config_nested_text_config_and_head_dim_fallback():
    cfg = minimax_config()
    del cfg["head_dim"]
    layout = jsk.SparseKVLayout.from_hf_config({"text_config": cfg}, num_slots=64, page_size=16)
    assert layout.head_dim == 256 // 8


def test_from_hf_config_without_sparse_attention_is_dense():
    cfg = minimax_config(use_sparse_attention=False)
    layout = jsk.SparseKVLayout.from_hf_config(cfg, num_slots=64, page_size=16)
    assert layout.dense_layer_ids == tuple(range(6)) and layout.sparse_layer_ids == ()


@pytest.mark.parametrize(
    "cfg, overrides, match",
    [
        (
            minimax_config(sparse_attention_freq=[1, 1]),
            {},
            r"sparse_attention_config.sparse_attention_freq has 2 entries but num_hidden_layers=6",
        ),
        ({"num_key_value_heads": 2, "head_dim": 8}, {}, r"missing 'num_hidden_layers'"),
        (minimax_config(), {"num_slot": 3}, r"unknown layout fields in overrides: \['num_slot'\]"),
        ([1, 2], {}, r"config must be a dict"),
    ],
)
def test_from_hf_config_errors(cfg, overrides, match):
    with pytest.raises(LayoutError, match=match):
        jsk.SparseKVLayout.from_hf_config(cfg, **overrides)


def test_from_hf_config_k_only_must_be_sparse():
    # disable_index_value set on a dense layer is ignored: only sparse layers can be K-only.
    cfg = minimax_config(sparse_disable_index_value=[1] * 6)
    layout = jsk.SparseKVLayout.from_hf_config(cfg, num_slots=64, page_size=16)
    assert layout.k_only_layer_ids == (2, 3, 4, 5)
