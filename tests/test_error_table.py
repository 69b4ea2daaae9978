"""Every bad input, its exception type and message: one test per row of docs/errors.md.

The table in docs/errors.md is generated from CASES by running them; the test
fails if the file differs. Regenerate it with:

    JSK_UPDATE_DOCS=1 python -m pytest tests/test_error_table.py
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.common import small_layout

import jax_sparse_kv as jsk
from jax_sparse_kv import errors
from jax_sparse_kv.checked import JaxRuntimeError, checked
from jax_sparse_kv.paging import PageAllocator

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
LOC = jnp.array([8, 9], jnp.int32)
K, V, IK = jnp.ones((2, 2, 8)), jnp.ones((2, 2, 6)), jnp.ones((2, 1, 4))


def cache(**kw):
    return jsk.SparseKVCache.zeros(small_layout(**kw))


def cli(*argv):
    from jax_sparse_kv.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as e:
            raise CLIExit(f"exit {e.code}: " + err.getvalue().strip().splitlines()[-1]) from None


class CLIExit(Exception):
    """A CLI call that exited with an error (status and last stderr line)."""


def save_then_restore_other(tmp):
    from jax_sparse_kv.checkpoint import restore_cache, save_cache

    save_cache(tmp / "ckpt", cache())
    restore_cache(tmp / "ckpt", small_layout(num_slots=64))


def sharded_bad_heads():
    from jax.sharding import AbstractMesh

    from jax_sparse_kv.sharding import pool_partition_specs

    pool_partition_specs(small_layout(), AbstractMesh((3,), ("tp",)))


def model_with_wrong_cache():
    from jax_sparse_kv.nn import MiniMaxM3, tiny_config

    model = MiniMaxM3(tiny_config(), seed=0)
    model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache(), jnp.ones((1, 2), jnp.int32))


def allocator(action):
    a = PageAllocator(num_pages=2, page_size=8)
    pages = a.alloc_pages(1)
    if action == "exhaust":
        a.alloc(17)
    elif action == "double":
        a.free_pages(pages)
        a.free_pages(pages)
    elif action == "pad":
        a.free_pages([0])
    elif action == "range":
        a.free_pages([5])


@functools.cache
def _engine():
    from jax_sparse_kv import serving
    from jax_sparse_kv.nn import MiniMaxM3, tiny_config

    model = MiniMaxM3(tiny_config(), seed=0)
    return serving.Engine(
        model, num_pages=4, page_size=8, dtype=jnp.float32, max_seqs=2, max_tokens_per_step=8, max_model_len=64
    )


def engine_add(prompt, request_id=None, **params):
    from jax_sparse_kv import serving

    eng = _engine()
    if request_id is not None and request_id not in eng._requests:
        eng.add_request([1], serving.SamplingParams(max_tokens=1), request_id=request_id)
    eng.add_request(prompt, serving.SamplingParams(**params), request_id=request_id)


def experts_on_3_devices():
    from jax.sharding import AbstractMesh

    from jax_sparse_kv.nn import MiniMaxM3, tiny_config
    from jax_sparse_kv.nn.parallel import model_partition_specs

    model = MiniMaxM3(tiny_config(num_key_value_heads=2, num_local_experts=3), seed=None)
    model_partition_specs(model, AbstractMesh((2,), ("tp",)))


def checked_write(loc, k):
    checked(lambda c, loc, k: c.set_kv_buffer(0, loc, k, jnp.ones((2, 2, 6))))(cache(), loc, k)


# (area, bad input, call shown in the docs, thunk, exception type, message pattern)
CASES = [
    (
        "layer",
        "unknown layer id",
        "cache.get_key_buffer(9)",
        lambda: cache().get_key_buffer(9),
        errors.UnknownLayerError,
        r"layer_id=9 is not an attention layer; attention layers: \[0, 1, 2, 3, 4, 5, 6, 7, 8\]",
    ),
    (
        "layer",
        "unknown layer id (write)",
        "cache.set_kv_buffer(42, loc, k, v)",
        lambda: cache().set_kv_buffer(42, LOC, K, V),
        errors.UnknownLayerError,
        r"layer_id=42 ",
    ),
    (
        "layer",
        "dense layer asked for index K",
        "cache.get_index_k_buffer(1)",
        lambda: cache().get_index_k_buffer(1),
        errors.NotSparseLayerError,
        r"layer_id=1 is not a sparse attention layer; sparse layers: \[3, 4, 5, 6, 7, 8\]",
    ),
    (
        "layer",
        "dense layer, index K write",
        "cache.set_index_k_buffer(0, loc, idx_k)",
        lambda: cache().set_index_k_buffer(0, LOC, IK),
        errors.NotSparseLayerError,
        r"layer_id=0 is not a sparse",
    ),
    (
        "layer",
        "dense layer, fused write",
        "cache.set_fused_kv_index_buffer(2, loc, k, v, idx_k)",
        lambda: cache().set_fused_kv_index_buffer(2, LOC, K, V, IK),
        errors.NotSparseLayerError,
        r"layer_id=2 is not a sparse",
    ),
    (
        "layer",
        "index-KV layer, K-only write",
        "cache.set_index_k_buffer(6, loc, idx_k)",
        lambda: cache().set_index_k_buffer(6, LOC, IK),
        errors.NotKOnlyLayerError,
        r"layer_id=6 is not in the K-only sparse group .*K-only layers: \[3, 4, 5\]",
    ),
    (
        "layer",
        "index-KV layer, fused write without idx_v",
        "cache.set_fused_kv_index_buffer(7, loc, k, v, idx_k)",
        lambda: cache().set_fused_kv_index_buffer(7, LOC, K, V, IK),
        errors.NotKOnlyLayerError,
        r"layer_id=7 ",
    ),
    (
        "layer",
        "dense layer asked for index K/V",
        "cache.get_index_kv_buffer(1)",
        lambda: cache().get_index_kv_buffer(1),
        errors.NoIndexValueError,
        r"layer_id=1 has no index V cache \(it is a dense layer\); index-KV layers: \[6, 7, 8\]",
    ),
    (
        "layer",
        "K-only layer asked for index K/V",
        "cache.get_index_kv_buffer(4)",
        lambda: cache().get_index_kv_buffer(4),
        errors.NoIndexValueError,
        r"layer_id=4 has no index V cache \(it is a K-only sparse layer\)",
    ),
    (
        "layer",
        "K-only layer, index K/V write",
        "cache.set_index_kv_buffer(3, loc, idx_k, idx_v)",
        lambda: cache().set_index_kv_buffer(3, LOC, IK, IK),
        errors.NoIndexValueError,
        r"layer_id=3 ",
    ),
    (
        "layer",
        "K-only layer, fused write with idx_v",
        "cache.set_fused_kv_index_buffer(5, loc, k, v, idx_k, idx_v)",
        lambda: cache().set_fused_kv_index_buffer(5, LOC, K, V, IK, IK),
        errors.NoIndexValueError,
        r"layer_id=5 ",
    ),
    (
        "layer",
        "layer of another pipeline stage",
        "stage_cache.get_key_buffer(0)  # stage [2, 7)",
        lambda: cache(start_layer=2, end_layer=7).get_key_buffer(0),
        errors.NotLocalLayerError,
        r"layer_id=0 \(attention layer\) is not local to this pipeline stage \[2, 7\)",
    ),
    (
        "layer",
        "traced layer id",
        "jax.jit(lambda c, i: c.get_key_buffer(i))(cache, 3)",
        lambda: jax.jit(lambda c, i: c.get_key_buffer(i))(cache(), 3),
        TypeError,
        r"layer_id must be a static Python int, got a JAX value",
    ),
    (
        "layer",
        "non-int layer id",
        "cache.get_key_buffer(3.0)",
        lambda: cache().get_key_buffer(3.0),
        TypeError,
        r"layer_id must be a static Python int, got float: 3.0",
    ),
    (
        "input",
        "k of the wrong shape",
        "cache.set_kv_buffer(0, loc, k[..., :7], v)",
        lambda: cache().set_kv_buffer(0, LOC, K[..., :7], V),
        ValueError,
        r"k must have shape \(2, 2, 8\) \(n = len\(loc\)\), got \(2, 2, 7\)",
    ),
    (
        "input",
        "v of another length than loc",
        "cache.set_kv_buffer(0, loc, k, v3)",
        lambda: cache().set_kv_buffer(0, LOC, K, jnp.ones((3, 2, 6))),
        ValueError,
        r"v must have shape \(2, 2, 6\) \(n = len\(loc\)\), got \(3, 2, 6\)",
    ),
    (
        "input",
        "integer k",
        "cache.set_kv_buffer(0, loc, k.astype(int32), v)",
        lambda: cache().set_kv_buffer(0, LOC, K.astype(jnp.int32), V),
        ValueError,
        r"k must have a floating dtype, got int32",
    ),
    (
        "input",
        "2-D loc",
        "cache.set_kv_buffer(0, loc[:, None], k, v)",
        lambda: cache().set_kv_buffer(0, LOC[:, None], K, V),
        ValueError,
        r"loc must be a 1-D integer array \[n\], got shape \(2, 1\)",
    ),
    (
        "input",
        "non-integer loc",
        "cache.set_kv_buffer(0, loc.astype(float32), k, v)",
        lambda: cache().set_kv_buffer(0, LOC.astype(jnp.float32), K, V),
        ValueError,
        r"loc must have an integer dtype, got float32",
    ),
    (
        "input",
        "index K without the head axis",
        "cache.set_index_k_buffer(3, loc, idx_k[:, 0])",
        lambda: cache().set_index_k_buffer(3, LOC, IK[:, 0]),
        ValueError,
        r"idx_k must have shape \(2, 1, 4\)",
    ),
    (
        "input",
        "non-scalar scale",
        "cache.set_kv_buffer(0, loc, k, v, k_scale=jnp.ones(3))",
        lambda: cache().set_kv_buffer(0, LOC, K, V, k_scale=jnp.ones(3)),
        ValueError,
        r"k scale must be a scalar \(shape \(\) or \(1,\)\), got shape \(3,\)",
    ),
    (
        "input",
        "zero or negative scale",
        "cache.set_kv_buffer(0, loc, k, v, v_scale=0.0)",
        lambda: cache().set_kv_buffer(0, LOC, K, V, v_scale=0.0),
        ValueError,
        r"v scale must be a positive scalar or None, got 0.0",
    ),
    (
        "input",
        "subnormal scale",
        "cache.set_kv_buffer(0, loc, k, v, k_scale=1e-39)",
        lambda: cache().set_kv_buffer(0, LOC, K, V, k_scale=1e-39),
        ValueError,
        r"k scale must be a normal float32 \(from 1.1755e-38 to 3.4028e\+38\), got 1e-39: XLA:CPU flushes a subnormal",
    ),
    (
        "input",
        "move with mismatched lengths",
        "cache.move_kv_cache(loc, jnp.arange(3))",
        lambda: cache().move_kv_cache(LOC, jnp.arange(3)),
        ValueError,
        r"tgt_loc and src_loc must have the same shape, got \(2,\) and \(3,\)",
    ),
    (
        "input",
        "block from another layout",
        "bf16_cache.scatter_slots(f32_block, slots)",
        lambda: cache(dtype=jnp.bfloat16).scatter_slots(cache().gather_slots(LOC), LOC),
        ValueError,
        r"block layout does not match the cache: dtype: block dtype\('float32'\), cache dtype\(bfloat16\)",
    ),
    (
        "input",
        "block and slots of different lengths",
        "cache.scatter_slots(block_of_2, jnp.arange(3))",
        lambda: cache().scatter_slots(cache().gather_slots(LOC), jnp.arange(3)),
        ValueError,
        r"block holds 2 tokens but 3 slots were given",
    ),
    (
        "input",
        "zeros of something not a layout",
        "SparseKVCache.zeros({...})",
        lambda: jsk.SparseKVCache.zeros({"num_slots": 8}),
        TypeError,
        r"layout must be a SparseKVLayout, got dict",
    ),
    (
        "input",
        "model and cache of different layouts",
        "model(tokens, positions, other_cache, table)",
        model_with_wrong_cache,
        ValueError,
        r"cache layout does not match the model: dense_layer_ids: model \(0, 3\), layout \(0, 1, 2\)",
    ),
    (
        "layout",
        "a layer both dense and sparse",
        "SparseKVLayout(dense_layer_ids=(0, 3), sparse_layer_ids=(3, ...))",
        lambda: small_layout(dense_layer_ids=(0, 3)),
        errors.LayoutError,
        r"layers cannot be both dense and sparse; offending ids: \[3\]",
    ),
    (
        "layout",
        "negative layer id",
        "SparseKVLayout(dense_layer_ids=(-1, 0), ...)",
        lambda: small_layout(dense_layer_ids=(-1, 0)),
        errors.LayoutError,
        r"dense_layer_ids must be non-negative; offending ids: \[-1\]",
    ),
    (
        "layout",
        "duplicate layer id",
        "SparseKVLayout(sparse_layer_ids=(3, 3, ...), ...)",
        lambda: small_layout(sparse_layer_ids=(3, 3, 4, 5, 6, 7, 8)),
        errors.LayoutError,
        r"sparse_layer_ids has duplicate ids: \[3\]",
    ),
    (
        "layout",
        "K-only layer that is not sparse",
        "SparseKVLayout(k_only_layer_ids=(1, 3), ...)",
        lambda: small_layout(k_only_layer_ids=(1, 3)),
        errors.LayoutError,
        r"k_only_layer_ids must be a subset of sparse_layer_ids; offending ids: \[1\]",
    ),
    (
        "layout",
        "num_slots not a multiple of page_size",
        "SparseKVLayout(num_slots=30, page_size=8, ...)",
        lambda: small_layout(num_slots=30),
        errors.LayoutError,
        r"num_slots=30 must be a multiple of page_size=8",
    ),
    (
        "layout",
        "non-positive size",
        "SparseKVLayout(head_num=0, ...)",
        lambda: small_layout(head_num=0),
        errors.LayoutError,
        r"head_num must be a positive int, got 0",
    ),
    (
        "layout",
        "unsupported dtype",
        "SparseKVLayout(dtype=jnp.int8, ...)",
        lambda: small_layout(dtype=jnp.int8),
        errors.LayoutError,
        r"dtype=int8 is not supported; supported dtypes: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2",
    ),
    (
        "layout",
        "empty pipeline stage range",
        "SparseKVLayout(start_layer=5, end_layer=5, ...)",
        lambda: small_layout(start_layer=5, end_layer=5),
        errors.LayoutError,
        r"end_layer=5 must be greater than start_layer=5",
    ),
    (
        "layout",
        "no attention layer at all",
        "SparseKVLayout(dense_layer_ids=(), sparse_layer_ids=(), ...)",
        lambda: small_layout(dense_layer_ids=(), sparse_layer_ids=(), k_only_layer_ids=()),
        errors.LayoutError,
        r"a layout needs at least one attention layer",
    ),
    (
        "layout",
        "stage ranges with a gap",
        "layout.split_stages([(0, 3), (4, 9)])",
        lambda: small_layout().split_stages([(0, 3), (4, 9)]),
        errors.LayoutError,
        r"stage ranges \[\(0, 3\), \(4, 9\)\] must tile \[0, 9\) in order without gaps",
    ),
    (
        "layout",
        "more stages than layers",
        "layout.split_stages(10)",
        lambda: small_layout().split_stages(10),
        errors.LayoutError,
        r"cannot split 9 local layers into 10 stages",
    ),
    (
        "config",
        "sparse_attention_freq of the wrong length",
        "SparseKVLayout.from_hf_config(cfg_with_2_flags_for_4_layers)",
        lambda: jsk.SparseKVLayout.from_hf_config(
            {
                "num_hidden_layers": 4,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "sparse_attention_config": {"sparse_attention_freq": [0, 1]},
            },
            num_slots=8,
            page_size=8,
        ),
        errors.LayoutError,
        r"sparse_attention_config.sparse_attention_freq has 2 entries but num_hidden_layers=4",
    ),
    (
        "config",
        "config without num_hidden_layers",
        "SparseKVLayout.from_hf_config({'head_dim': 8})",
        lambda: jsk.SparseKVLayout.from_hf_config({"head_dim": 8}),
        errors.LayoutError,
        r"config is missing 'num_hidden_layers'",
    ),
    (
        "config",
        "misspelt override",
        "SparseKVLayout.from_hf_config(cfg, num_slot=64)",
        lambda: jsk.SparseKVLayout.from_hf_config({"num_hidden_layers": 1}, num_slot=64),
        errors.LayoutError,
        r"unknown layout fields in overrides: \['num_slot'\]",
    ),
    (
        "checkpoint",
        "restore into another layout",
        "restore_cache(path, other_layout)",
        "tmp:save_then_restore_other",
        errors.LayoutError,
        r"checkpoint layout differs from the expected layout: num_slots: saved 32, expected 64",
    ),
    (
        "sharding",
        "heads not divisible by the mesh axis",
        "SparseKVCache.zeros(layout_with_2_heads, mesh=mesh_of_3)",
        sharded_bad_heads,
        ValueError,
        r"head_num=2 is not divisible by the size 3 of mesh axis 'tp'",
    ),
    (
        "allocator",
        "more tokens than free pages",
        "PageAllocator(2, 8).alloc(17)  # after 1 page taken",
        lambda: allocator("exhaust"),
        errors.OutOfCapacityError,
        r"out of capacity: asked for 3 pages, 1 free of 2 \(8 slots each\)",
    ),
    (
        "allocator",
        "double free",
        "allocator.free_pages(pages)  # twice",
        lambda: allocator("double"),
        errors.AllocatorError,
        r"double free of pages \[1\]",
    ),
    (
        "allocator",
        "freeing the padding page",
        "allocator.free_pages([0])",
        lambda: allocator("pad"),
        errors.AllocatorError,
        r"page 0 is the padding page",
    ),
    (
        "allocator",
        "page out of range",
        "allocator.free_pages([5])",
        lambda: allocator("range"),
        errors.AllocatorError,
        r"pages \[5\] are out of range 1..2",
    ),
    (
        "checked",
        "out-of-range loc (checked mode)",
        "checked(step)(cache, jnp.array([8, 99]), k)",
        lambda: checked_write(jnp.array([8, 99]), K),
        JaxRuntimeError,
        r"loc out of range: min 8, max 99; valid slots are \[0, 40\)",
    ),
    (
        "checked",
        "duplicate slot (checked mode)",
        "checked(step)(cache, jnp.array([9, 9]), k)",
        lambda: checked_write(jnp.array([9, 9]), K),
        JaxRuntimeError,
        r"duplicate non-padding slot 9 in one write",
    ),
    (
        "checked",
        "NaN written (checked mode)",
        "checked(step)(cache, loc, k_with_nan)",
        lambda: checked_write(LOC, K.at[1, 0, 0].set(jnp.nan)),
        JaxRuntimeError,
        r"non-finite value written to slot 9",
    ),
    (
        "cli",
        "tensor-parallel size that does not divide the heads",
        "python -m jax_sparse_kv plan --tp 3",
        lambda: cli("plan", "--tp", "3"),
        CLIExit,
        r"exit 2: error: head_num=4 is not divisible by tp=3",
    ),
    (
        "cli",
        "unreadable memory size",
        "python -m jax_sparse_kv plan --memory lots",
        lambda: cli("plan", "--memory", "lots"),
        CLIExit,
        r"exit 2: error: cannot read a memory size from 'lots'; use e.g. 80GiB or 40GB",
    ),
    (
        "cli",
        "missing config file",
        "python -m jax_sparse_kv plan --config nope.json",
        lambda: cli("plan", "--config", "nope.json"),
        CLIExit,
        r"exit 2: error: cannot read --config nope.json: No such file or directory",
    ),
    (
        "cli",
        "unknown dtype",
        "python -m jax_sparse_kv demo --dtype int8",
        lambda: cli("demo", "--dtype", "int8"),
        CLIExit,
        r"exit 2: .*invalid choice: 'int8'",
    ),
    (
        "cli",
        "devices that do not divide the heads",
        "python -m jax_sparse_kv demo --devices 3",
        lambda: cli("demo", "--devices", "3"),
        CLIExit,
        r"exit 2: error: --devices 3",
    ),
    (
        "engine",
        "empty prompt",
        "engine.add_request([], params)",
        lambda: engine_add([]),
        ValueError,
        r"prompt_token_ids must be a non-empty 1-D sequence of ints",
    ),
    (
        "engine",
        "token id outside the vocabulary",
        "engine.add_request([1, 256], params)",
        lambda: engine_add([1, 256]),
        ValueError,
        r"prompt_token_ids has token id 256 outside \[0, vocab_size=256\)",
    ),
    (
        "engine",
        "prompt + max_tokens over max_model_len",
        "engine.add_request([1] * 60, SamplingParams(max_tokens=8))",
        lambda: engine_add([1] * 60, max_tokens=8),
        ValueError,
        r"exceeds max_model_len=64",
    ),
    (
        "engine",
        "a request that could never fit the cache",
        "engine.add_request([1] * 40, SamplingParams(max_tokens=8))  # 4 pages of 8",
        lambda: engine_add([1] * 40, max_tokens=8),
        ValueError,
        r"needs 6 pages of 8 tokens; the cache has num_pages=4: it could never fit",
    ),
    (
        "engine",
        "max_tokens < 1",
        "SamplingParams(max_tokens=0)",
        lambda: engine_add([1], max_tokens=0),
        ValueError,
        r"max_tokens must be an int >= 1, got 0",
    ),
    (
        "engine",
        "negative temperature",
        "SamplingParams(temperature=-1.0)",
        lambda: engine_add([1], temperature=-1.0),
        ValueError,
        r"temperature must be >= 0, got -1.0",
    ),
    (
        "engine",
        "top_p outside (0, 1]",
        "SamplingParams(top_p=0.0)",
        lambda: engine_add([1], top_p=0.0),
        ValueError,
        r"top_p must be in \(0, 1\], got 0.0",
    ),
    (
        "engine",
        "negative top_k",
        "SamplingParams(top_k=-1)",
        lambda: engine_add([1], top_k=-1),
        ValueError,
        r"top_k must be an int >= 0 \(0 = all tokens\), got -1",
    ),
    (
        "engine",
        "duplicate request id",
        "engine.add_request([1], params, request_id='a')  # twice",
        lambda: engine_add([1], request_id="a"),
        ValueError,
        r"request_id='a' is already in use",
    ),
    (
        "sharding",
        "a mesh axis that does not divide the experts",
        "model_partition_specs(model, mesh)  # 3 experts, tp=2",
        experts_on_3_devices,
        ValueError,
        r"num_local_experts=3 is not divisible by the size 2 of mesh axis 'tp'",
    ),
]


def stored(dtype, x, scale=None, in_dtype=jnp.float32) -> float:
    """What a one-value write of `x` (as `in_dtype`) into a `dtype` pool stores, read back as a float."""
    k = jnp.full((2, 2, 8), x, jnp.float32).astype(in_dtype)
    out = cache(dtype=dtype).set_kv_buffer(0, LOC, k, k.astype(jnp.float32)[..., :6], k_scale=scale)
    return float(out.get_key_buffer(0)[8, 0, 0].astype(jnp.float32))


# Writes that store something other than the input without an error:
# (what, call, thunk, expected stored value). The sign of a zero matters.
VALUE_CASES = [
    (
        "value that does not fit: saturated",
        "fp8_cache.set_kv_buffer(0, loc, full(500.0), v)",
        lambda: stored(jnp.float8_e4m3fn, 500.0),
        448.0,
    ),
    (
        "quotient halfway between two fp8 values: to even",
        "fp8_cache.set_kv_buffer(0, loc, full(1.40625), v, k_scale=0.9)",
        lambda: stored(jnp.float8_e4m3fn, 1.40625, 0.9),
        1.5,
    ),
    (
        "subnormal f32 input, no scale: kept",
        "bf16_cache.set_kv_buffer(0, loc, full(1e-39), v)",
        lambda: stored(jnp.bfloat16, 1e-39),
        float(jnp.asarray(1e-39, jnp.bfloat16).astype(jnp.float32)),
    ),
    (
        "subnormal f32 input with a scale: flushed to signed zero",
        "bf16_cache.set_kv_buffer(0, loc, full(-1e-39), v, k_scale=0.5)",
        lambda: stored(jnp.bfloat16, -1e-39, 0.5),
        -0.0,
    ),
    (
        "subnormal quotient: flushed to signed zero",
        "f32_cache.set_kv_buffer(0, loc, full(2e-38, bf16), v, k_scale=4.0)",
        lambda: stored(jnp.float32, 2e-38, 4.0, jnp.bfloat16),
        0.0,
    ),
]


@pytest.mark.parametrize("case", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_value_changed_on_write(case):
    _, _, thunk, want = case
    got = thunk()
    assert got == want and np.signbit(got) == np.signbit(want), (got, want)


def run_case(thunk, tmp_path):
    if isinstance(thunk, str) and thunk.startswith("tmp:"):
        return globals()[thunk[4:]](tmp_path)
    return thunk()


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_bad_input(case, tmp_path):
    _, _, _, thunk, error, pattern = case
    with pytest.raises(error, match=pattern):
        run_case(thunk, tmp_path)


def _message(case, tmp_path) -> str:
    try:
        run_case(case[3], tmp_path)
    except case[4] as e:
        text = str(e).strip().splitlines()[0]
        text = re.sub(r" \(`check` failed\)$", "", text)
        return text if len(text) <= 160 else text[:157] + "..."
    raise AssertionError(f"{case[1]}: no error")


def render(tmp_path) -> str:
    lines = [
        "# Bad inputs and the errors they get",
        "",
        "Generated from `tests/test_error_table.py` (`JSK_UPDATE_DOCS=1 python -m pytest tests/test_error_table.py`);",
        "every row is a test. Layer-group errors are raised while `jax.jit` traces. All `LayerGroupError`s are",
        "also `ValueError`s; `LayoutError` and `AllocatorError` are `ValueError`s; checked-mode errors are",
        "`jax.experimental.checkify.JaxRuntimeError` (a `ValueError`). Layout: dense 0-2, K-only sparse 3-5,",
        "index-KV sparse 6-8, 32 slots + a padding page of 8 rows.",
        "",
        "| area | bad input | call | exception | message |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        area, what, call, _, error, _ = case
        name = "exit status 2 (stderr)" if error is CLIExit else error.__name__
        message = _message(case, tmp_path).replace("|", "\\|")
        lines.append(f"| {area} | {what} | `{call}` | {name} | {message} |")
    lines += [
        "",
        "## Values a write changes without an error",
        "",
        "A write whose input dtype differs from the pool's stores the correctly rounded f32 `x / scale`,",
        "saturated to the pool's finite range and rounded once to nearest-even. With a scale, f32 subnormals",
        "(below `finfo(float32).tiny`, inputs and quotients) are flushed to zero of the same sign on every",
        "backend, as XLA:CPU's arithmetic does; without a scale they are kept. `full(x)` is a `k` of `x` in f32.",
        "",
        "| input | call | stored |",
        "|---|---|---|",
    ]
    for what, call, thunk, _ in VALUE_CASES:
        lines.append(f"| {what} | `{call}` | {thunk()!r} |")
    return "\n".join(lines) + "\n"


def test_docs_table_matches_the_cases(tmp_path):
    text = render(tmp_path)
    if os.environ.get("JSK_UPDATE_DOCS") == "1":
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
    assert DOC.exists(), "docs/errors.md is missing: run with JSK_UPDATE_DOCS=1"
    assert DOC.read_text() == text, "docs/errors.md is stale: run with JSK_UPDATE_DOCS=1"
