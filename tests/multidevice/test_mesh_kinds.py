"""Any mesh a JAX user makes: `Explicit` axes (`jax.make_mesh`) and `Auto` axes (`jax.sharding.Mesh`),
under the user's own `jax.jit` (with and without `jax.set_mesh`) and under `make_step(mesh=)`, for cache
writes and model steps (8 CPU devices)."""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sparse_kv as jsk
from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.nn.decode import DecodeStep
from jax_sparse_kv.nn.parallel import model_partition_specs, shard_model

COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")
MOSAIC = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"
KINDS = ["explicit", "auto"]
CONTEXTS = ["plain", "set_mesh"]  # jax.sharding.use_mesh is gone in JAX 0.10 (set_mesh replaced it)


def make_mesh(kind, n=8, names=("tp",)):
    shape = (n,) if len(names) == 1 else (2, n // 2)
    if kind == "explicit":
        mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])  # Explicit axes by default in JAX 0.10
        assert all(t == AxisType.Explicit for t in mesh.axis_types)
        return mesh
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)  # Auto axes


def context(name, mesh):
    if name == "set_mesh":
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def layout(dtype):
    return jsk.SparseKVLayout(
        dense_layer_ids=(0,),
        sparse_layer_ids=(1, 2),
        k_only_layer_ids=(1,),
        num_slots=256,
        page_size=16,
        head_num=8,
        head_dim=16,
        index_head_dim=16,
        dtype=dtype,
    )


DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp8": jnp.float8_e4m3fn,
    "fp8e5": jnp.float8_e5m2,
}


def write_fn(lay):
    def write(c, loc, k, ik):
        c = c.set_kv_buffer(0, loc, k, k, k_scale=0.5, v_scale=0.5)
        c = c.set_fused_kv_index_buffer(1, loc, k, k, ik)
        return c.set_fused_kv_index_buffer(2, loc, k, k, ik, ik)

    return write


def write_inputs(lay):
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(8, lay.head_num, 16)), jnp.float32)
    ik = jnp.asarray(rng.normal(size=(8, 1, 16)), jnp.float32)
    return jnp.arange(16, 24, dtype=jnp.int32), k, ik


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_write_in_a_plain_jit(kind, dtype, ctx):
    """The issue's program: a sharded cache written in the user's own `jax.jit`, donated: no collectives,
    the shardings kept, the values those of an unsharded write."""
    lay, mesh = layout(DTYPES[dtype]), make_mesh(kind)
    loc, k, ik = write_inputs(lay)
    fn = write_fn(lay)
    want = jax.jit(fn)(jsk.SparseKVCache.zeros(lay), loc, k, ik)
    with context(ctx, mesh):
        cache = jsk.SparseKVCache.zeros(lay, mesh=mesh)
        f = jax.jit(fn, donate_argnums=0)
        assert not COLLECTIVES.search(f.lower(cache, loc, k, ik).compile().as_text())
        got = f(cache, loc, k, ik)
    assert got.k[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)
    assert got.index_k[0].sharding.is_fully_replicated
    assert cache.k[0].is_deleted()  # donated: written in place
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", KINDS)
def test_plain_jit_write_exports_for_tpu_with_a_scatter_per_device(kind):
    """Lowered for 8 TPUs outside any manual region, the write is XLA's scatter (which GSPMD partitions), not
    the Mosaic kernel (which cannot be partitioned; on one device the kernel stays, tests/test_tpu_write.py).
    With `Auto` axes only the lowering knows the program is partitioned: `platform.per_device_or_xla`."""
    lay, mesh = layout(jnp.bfloat16), make_mesh(kind)
    cache = jsk.SparseKVCache.zeros(lay, mesh=mesh)
    exported = export.export(jax.jit(write_fn(lay), donate_argnums=0), platforms=["tpu"])(cache, *write_inputs(lay))
    text = exported.mlir_module()
    assert exported.nr_devices == 8
    assert MOSAIC not in text and "stablehlo.scatter" in text

    # inside shard_map over the head axis the body is per device: the kernel is lowered there
    loc, k, _ = write_inputs(lay)
    rows = jax.device_put(jsk.storage.encode(k, jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
    per_device = jax.shard_map(
        jsk.storage.write_rows,
        mesh=mesh,
        in_specs=(P(None, "tp"), P(), P(None, "tp")),
        out_specs=P(None, "tp"),
        check_vma=False,  # as ops.pallas.over_heads: the kernel does not declare how its output varies
    )
    text = export.export(jax.jit(per_device), platforms=["tpu"])(cache.k[0], loc, rows).mlir_module()
    assert text.count(MOSAIC) == 1 and "sdy.manual_computation" in text


CONFIG = tiny_config(
    "dsds",
    disable_index_value=(True, True, True, False),
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=8,
    rotary_dim=8,
    hidden_size=64,
    index_n_heads=8,
    index_head_dim=16,
    num_local_experts=8,
)
PROMPTS = [list(range(3, 20)), list(range(40, 49))]
TABLE = np.arange(1, 13).reshape(6, 2).T


@pytest.fixture(scope="module")
def reference():
    lay = CONFIG.layout(num_slots=32 * 8, page_size=8, dtype=jnp.float32)
    step = make_step(MiniMaxM3(CONFIG, seed=3))
    return DecodeSession(step, jsk.SparseKVCache.zeros(lay), jnp.asarray(TABLE, jnp.int32)).generate(PROMPTS, 4)


def plain_step(model):
    """The user's own jitted step (no make_step): the model called in `jax.jit`, cache donated."""
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=3)
    def step(params, tokens, positions, cache, table):
        return nnx.merge(graphdef, params)(tokens, positions, cache, table)

    return params, step


@pytest.mark.parametrize("how", ["make_step", "plain_jit", "plain_jit_set_mesh"])
@pytest.mark.parametrize("kind", KINDS)
def test_model_steps_on_any_mesh(kind, how, reference):
    """Prefill + decode of a tensor- and expert-parallel model gives the single-device tokens; the cache
    keeps its shardings step after step (donated, one program per shape)."""
    mesh = make_mesh(kind)
    lay = CONFIG.layout(num_slots=32 * 8, page_size=8, dtype=jnp.float32)
    model = shard_model(MiniMaxM3(CONFIG, seed=3), mesh)
    with context("set_mesh" if how == "plain_jit_set_mesh" else "plain", mesh):
        cache = jsk.SparseKVCache.zeros(lay, mesh=mesh)
        if how == "make_step":
            step = make_step(model, mesh=mesh)
        else:
            params, fn = plain_step(model)
            step = DecodeStep(params, fn)
        session = DecodeSession(step, cache, jnp.asarray(TABLE, jnp.int32))
        tokens, logits = session.generate(PROMPTS, 4)
    np.testing.assert_array_equal(tokens, reference[0])
    for a, b in zip(logits, reference[1], strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert session.cache.k[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)
    assert step.compilations() == 2  # prefill and decode; the cache comes back as it went in


@pytest.mark.parametrize("kind", KINDS)
def test_step_exports_with_kernels_per_device_on_any_mesh(kind):
    """make_step(mesh=) on 4 devices of either kind: decode attention's kernels inside shard_map, the
    writes as scatters, for cuda and tpu."""
    config = tiny_config(
        "ds", num_attention_heads=16, num_key_value_heads=8, index_n_heads=8, head_dim=128, index_head_dim=128
    )
    mesh = make_mesh(kind, 4)
    model = shard_model(MiniMaxM3(config, seed=0, dtype=jnp.bfloat16), mesh)
    cache = jsk.SparseKVCache.zeros(config.layout(8 * 16, 16, jnp.bfloat16), mesh=mesh)
    step = make_step(model, mesh=mesh)
    args = (
        step.params,
        jnp.zeros((2, 1), jnp.int32),
        jnp.full((2, 1), 3, jnp.int32),
        cache,
        jnp.ones((2, 4), jnp.int32),
    )
    for platform, kernel in (("cuda", TRITON), ("tpu", MOSAIC)):
        exported = export.export(
            step.fn, platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
        )(*args)
        text = exported.mlir_module()
        assert exported.nr_devices == 4
        # plus one per MoE layer: its experts split over the devices, their parts added by one psum; plus two per
        # sparse layer: the indexer's block scores and top-k, each on the device's own index heads
        moe = sum(t != "dense" for t in config.mlp_layer_types)
        regions = 2 + moe + 2 * len(config.sparse_layer_ids)
        assert text.count(kernel) == 2 and text.count("sdy.manual_computation") == regions, platform
        assert "stablehlo.scatter" in text and MOSAIC not in text.replace(kernel, ""), platform


@pytest.mark.parametrize("kind", KINDS)
def test_indivisible_heads_or_experts_name_the_axis(kind):
    mesh = make_mesh(kind)
    for fields, count in (
        ({"num_key_value_heads": 4, "num_attention_heads": 8}, "num_key_value_heads=4"),
        ({"num_local_experts": 12}, "num_local_experts=12"),
    ):
        config = tiny_config("ds", **{"num_attention_heads": 16, "num_key_value_heads": 8, **fields})
        with pytest.raises(ValueError, match=rf"{count} is not divisible by the size 8 of mesh axis 'tp'"):
            model_partition_specs(MiniMaxM3(config, seed=None), mesh)
        with pytest.raises(ValueError, match=rf"{count} is not divisible by the size 8 of mesh axis 'tp'"):
            shard_model(MiniMaxM3(config, seed=0), mesh)
    # a model without MoE layers has no experts to split
    dense = tiny_config("ds", "dd", num_attention_heads=16, num_key_value_heads=8, num_local_experts=12)
    assert model_partition_specs(MiniMaxM3(dense, seed=None), mesh)
