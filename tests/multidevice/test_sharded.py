"""Sharded caches on a mesh of 8 CPU devices: placement, no collectives, TP model step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sparse_kv as jsk
from jax_sparse_kv.cache import cache_shardings
from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.nn.parallel import shard_model
from jax_sparse_kv.sharding import pool_partition_specs

COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")


def mesh(n=8, name="tp"):
    return Mesh(np.array(jax.devices()[:n]), (name,))


def layout(dtype=jnp.bfloat16, heads=8, **kw):
    fields = dict(
        dense_layer_ids=(0, 1),
        sparse_layer_ids=(2, 3, 4, 5),
        k_only_layer_ids=(2, 4),
        num_slots=256,
        page_size=16,
        head_num=heads,
        head_dim=16,
        index_head_dim=16,
        dtype=dtype,
    )
    fields.update(kw)
    return jsk.SparseKVLayout(**fields)


def test_specs_and_indivisible_heads():
    specs = pool_partition_specs(layout(), mesh())
    assert specs["k"] == P(None, "tp") and specs["index_k"] == P()
    with pytest.raises(ValueError, match=r"head_num=4 is not divisible by the size 8 of mesh axis 'tp'"):
        jsk.SparseKVCache.zeros(layout(heads=4), mesh=mesh())
    with pytest.raises(ValueError, match=r"head_axis='x' is not an axis of the mesh"):
        pool_partition_specs(layout(), mesh(), head_axis="x")


def test_zeros_allocates_shards_directly_on_devices():
    lay = layout()
    cache = jsk.SparseKVCache.zeros(lay, mesh=mesh())
    for buf in cache.k + cache.v:
        assert buf.sharding.spec == P(None, "tp")
        assert {s.data.shape for s in buf.addressable_shards} == {(lay.num_rows, 1, 16)}
        assert len({s.device for s in buf.addressable_shards}) == 8
    for buf in cache.index_k + cache.index_kv_k + cache.index_kv_v:
        assert buf.sharding.is_fully_replicated
    # the creation program allocates per-device shards: no full-size temp or output per device
    shardings = cache_shardings(lay, mesh())
    from jax_sparse_kv.cache import _zeros_tree

    compiled = jax.jit(lambda: _zeros_tree(lay), out_shardings=shardings).lower().compile()
    per_device_main = lay.num_rows * 1 * 16 * 2
    per_device_index = lay.num_rows * 16 * 2
    expected = 6 * 2 * per_device_main + 6 * per_device_index  # 6 layers K+V, 2 K-only + 2x2 index-KV buffers
    assert compiled.memory_analysis().output_size_in_bytes <= expected + 1024
    assert compiled.memory_analysis().temp_size_in_bytes <= 1024


def sharded_inputs(lay, m, n=8):
    rng = np.random.default_rng(0)
    heads = NamedSharding(m, P(None, "tp"))
    rep = NamedSharding(m, P())
    k = jax.device_put(jnp.asarray(rng.normal(size=(n, lay.head_num, 16)), jnp.float32), heads)
    ik = jax.device_put(jnp.asarray(rng.normal(size=(n, 1, 16)), jnp.float32), rep)
    loc = jax.device_put(jnp.arange(16, 16 + n, dtype=jnp.int32), rep)
    return loc, k, ik


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_sharded_writes_reads_move_gather_scatter_have_no_collectives(dtype):
    lay, m = layout(dtype), mesh()
    cache = jsk.SparseKVCache.zeros(lay, mesh=m)
    loc, k, ik = sharded_inputs(lay, m)
    shardings = cache_shardings(lay, m)

    def write_all(c, loc, k, ik):
        for layer in lay.dense_layer_ids:
            c = c.set_kv_buffer(layer, loc, k, k, k_scale=0.5, v_scale=0.5)
        for layer in lay.sparse_layer_ids:
            c = c.set_fused_kv_index_buffer(layer, loc, k, k, ik, None if layer in lay.k_only_layer_ids else ik)
        return c

    programs = {
        "write": (jax.jit(write_all, donate_argnums=0, out_shardings=shardings), (cache, loc, k, ik)),
        "move": (jax.jit(lambda c, t, s: c.move_kv_cache(t, s), donate_argnums=0), (cache, loc + 64, loc)),
        "read": (jax.jit(lambda c: (c.get_kv_buffer(3), c.get_index_k_buffer(3))), (cache,)),
        "gather": (jax.jit(lambda c, s: c.gather_slots(s)), (cache, loc)),
    }
    for name, (fn, args) in programs.items():
        hlo = fn.lower(*args).compile().as_text()
        assert not COLLECTIVES.search(hlo), f"{name} compiled to a collective"

    new = programs["write"][0](cache, loc, k, ik)
    assert jax.tree.map(lambda x: x.sharding.spec, new) == jax.tree.map(lambda s: s.spec, shardings)
    got = np.asarray(new.get_key_buffer(0)[16:24].astype(jnp.float32))
    want = np.asarray((k / 0.5).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)

    moved = programs["move"][0](new, loc + 64, loc)
    assert moved.k[0].sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(moved.k[2][80:88]), np.asarray(moved.k[2][16:24]))

    block = programs["gather"][0](moved, loc)
    assert block.k[0].sharding.spec == P(None, "tp")
    scatter = jax.jit(lambda c, b, s: c.scatter_slots(b, s), donate_argnums=0)
    fresh = jsk.SparseKVCache.zeros(lay, mesh=m)
    assert not COLLECTIVES.search(scatter.lower(fresh, block, loc + 100).compile().as_text())
    out = scatter(fresh, block, loc + 100)
    np.testing.assert_array_equal(np.asarray(out.k[1][116:124]), np.asarray(block.k[1]))
    assert out.k[1].sharding.spec == P(None, "tp")


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-3)], ids=["f32", "bf16"])
def test_tensor_parallel_decode_equals_unsharded(dtype, tol):
    # Tolerance is relative to the largest logit. TP sums the output projection
    # across devices in another order, so K/V differ in the last f32 bits; a bf16
    # pool can round such a value to the neighbouring bf16 number (~4e-3 relative).
    # dense layer 0 (dense MLP); sparse 1-3 with MoE (8 experts: one per device), 1 and 3 K-only
    config = tiny_config(
        "dsss",
        disable_index_value=(True, True, False, True),
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        rotary_dim=8,
        hidden_size=64,
        index_n_heads=8,
        index_head_dim=16,
        num_local_experts=8,
    )
    lay = config.layout(num_slots=32 * 8, page_size=8, dtype=dtype)
    prompts = [list(range(3, 20)), list(range(40, 49))]
    table = jnp.asarray(np.arange(1, 13).reshape(6, 2).T, jnp.int32)

    ref = DecodeSession(make_step(MiniMaxM3(config, seed=3)), jsk.SparseKVCache.zeros(lay), table)
    ref_tokens, ref_logits = ref.generate(prompts, 6)

    m = mesh()
    model = shard_model(MiniMaxM3(config, seed=3), m)
    assert model.layers[0].self_attn.k_proj.weight[...].sharding.spec == P("tp", None)
    assert model.layers[2].self_attn.o_proj.weight[...].sharding.spec == P(None, "tp")
    assert model.layers[1].mlp.experts.down_proj[...].sharding.spec == P("tp", None, None)
    assert model.layers[1].self_attn.indexer.k_proj.weight[...].sharding.is_fully_replicated
    step = make_step(model, mesh=m)
    session = DecodeSession(step, jsk.SparseKVCache.zeros(lay, mesh=m), table)
    before = session.cache
    tokens, logits = session.generate(prompts, 6, warmup=True)  # prefill twice: same program both times
    np.testing.assert_array_equal(tokens, ref_tokens)
    for a, b in zip(logits, ref_logits, strict=True):
        assert np.abs(a - b).max() <= tol * np.abs(b).max()
    assert all(x.is_deleted() for x in jax.tree.leaves(before))  # donated
    assert session.cache.k[0].sharding.is_equivalent_to(NamedSharding(m, P(None, "tp")), 3)
    assert step.compilations() == 2


@pytest.mark.parametrize("scale", [1.0, "traced"])
def test_indexer_scores_and_top_k_stay_on_each_devices_index_heads(scale):
    """Under `head_parallel` (what a tensor-parallel step traces in), the indexer's block scores and top-k run per
    device on its own index heads: no collective, the blocks one device selects. XLA alone partitions top-k, and
    the score loop that merges the query and head axes, by gathering every head to every device (the gathered
    ``[batch, q_len, index_heads, blocks]`` f32 grows with the context)."""
    from jax_sparse_kv import ops
    from jax_sparse_kv.platform import head_parallel

    m, rng = mesh(4), np.random.default_rng(0)
    batch, q_len, heads, dim, page, pages = 2, 8, 4, 16, 8, 6
    iq = rng.normal(size=(batch, q_len, heads, dim)).astype(np.float32)
    pool = rng.normal(size=((1 + batch * pages) * page, 1, dim)).astype(np.float32)
    table = np.arange(1, 1 + batch * pages, dtype=np.int32).reshape(batch, pages)
    positions = (np.arange(q_len) + np.array([[20], [37]])).astype(np.int32)
    k_scale = jnp.float32(0.5) if scale == "traced" else scale

    def select(iq, pool, table, positions, k_scale):
        scores = ops.block_scores(iq, ops.PagedKV(pool, table, page, k_scale), positions, block_size=8)
        return ops.select_blocks(scores, positions, block_size=8, topk=3)

    def per_device(*args):
        with head_parallel(m, "tp"):
            return select(*args)

    want = jax.jit(select, static_argnums=() if scale == "traced" else (4,))(iq, pool, table, positions, k_scale)
    assert (np.asarray(want) >= 0).sum() > batch * q_len * heads  # not only the forced local blocks
    iq = jax.device_put(iq, NamedSharding(m, P(None, None, "tp")))
    f = jax.jit(per_device, static_argnums=() if scale == "traced" else (4,))
    assert not COLLECTIVES.search(f.lower(iq, pool, table, positions, k_scale).compile().as_text())
    np.testing.assert_array_equal(f(iq, pool, table, positions, k_scale), want)


def test_pallas_kernels_are_not_dispatched_under_a_multi_device_mesh():
    """pallas_call has no SPMD partitioning rule: under `jax.set_mesh` of 8 devices the ops take XLA."""
    from jax_sparse_kv.platform import pallas_enabled

    assert pallas_enabled()
    with jax.set_mesh(mesh()):
        assert not pallas_enabled()
        assert pallas_enabled(use_pallas=True)  # an explicit request still wins
    with jax.set_mesh(mesh(1)):
        assert pallas_enabled()


def test_tensor_parallel_step_exports_with_kernels_per_device():
    """make_step(mesh=...) on 4 devices: decode attention's Triton / Mosaic kernels inside shard_map (2 of
    8 KV heads per device), the cache writes as XLA scatters, for cuda and for tpu."""
    from jax import export

    config = tiny_config(
        "ds", num_attention_heads=16, num_key_value_heads=8, index_n_heads=8, head_dim=128, index_head_dim=128
    )
    m = mesh(4)
    model = shard_model(MiniMaxM3(config, seed=0, dtype=jnp.bfloat16), m)
    cache = jsk.SparseKVCache.zeros(config.layout(8 * 16, 16, jnp.bfloat16), mesh=m)
    step = make_step(model, mesh=m)
    args = (
        step.params,
        jnp.zeros((2, 1), jnp.int32),
        jnp.full((2, 1), 3, jnp.int32),
        cache,
        jnp.ones((2, 4), jnp.int32),
    )
    triton = "__gpu$xla.gpu.triton"
    for platform, kernel in (("cuda", triton), ("tpu", "tpu_custom_call")):
        exported = export.export(
            step.fn, platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)]
        )(*args)
        text = exported.mlir_module()
        assert exported.nr_devices == 4
        # one kernel per attention layer, each in its own per-device (manual) region; the writes stay scatters;
        # plus one per MoE layer: its experts split over the devices, their parts added by one psum; plus two per
        # sparse layer: the indexer's block scores and top-k, each on the device's own index heads
        moe = sum(t != "dense" for t in config.mlp_layer_types)
        regions = 2 + moe + 2 * len(config.sparse_layer_ids)
        assert text.count(kernel) == 2 and text.count("sdy.manual_computation") == regions, platform
        assert "stablehlo.scatter" in text and "tpu_custom_call" not in text.replace(kernel, ""), platform
