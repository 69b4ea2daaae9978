"""Pallas decode kernels in interpret mode against a NumPy reference of the contract.

The contract (also that of `jax_sparse_kv.ops.paged_decode`): token t of
sequence b is at row ``page_table[b, t // page_size] * page_size + t % page_size``;
the decode query sees tokens ``[0, lengths[b])``; query head h uses KV head
``h // (num_q_heads // kv_heads)`` and, for sparse attention, selection
``h // (num_q_heads // sel_heads)``, whose block j covers tokens
``[j * block_size, (j + 1) * block_size) ∩ [0, lengths[b])``.

GPU kernels run in Pallas interpret mode (``interpret=True``); TPU kernels in
the discharge interpreter (``interpret=True``), which models their DMAs, ref
reshapes/bitcasts and strided loads. (JAX's TPU interpreter,
``pltpu.InterpretParams``, does not support ref reshapes in JAX 0.10.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jax_sparse_kv.ops import pallas as jp

B, HQ, D, PS, MAX_PAGES = 3, 8, 128, 16, 6
LENGTHS = (37, 0, 96)  # ragged, a zero-length sequence, and a full table


def _reference(q, k_pages, v_pages, page_table, lengths, *, page_size, k_scale, v_scale, tokens_of=None):
    """Softmax attention over each head's tokens, in float64, from the stored values."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k_pages.astype(jnp.float32), np.float64) * k_scale
    v = np.asarray(v_pages.astype(jnp.float32), np.float64) * v_scale
    table, lengths = np.asarray(page_table), np.asarray(lengths)
    batch, num_q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = np.zeros((batch, num_q_heads, v.shape[2]))
    for b in range(batch):
        for h in range(num_q_heads):
            tokens = range(lengths[b]) if tokens_of is None else tokens_of(b, h)
            rows = [table[b, t // page_size] * page_size + t % page_size for t in tokens]
            if not rows:
                continue
            kh = h // (num_q_heads // kv_heads)
            s = k[rows, kh] @ q[b, h] * head_dim**-0.5
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ v[rows, kh]
    return out


def _sparse_tokens(selected, lengths, block_size, num_q_heads):
    selected, lengths = np.asarray(selected), np.asarray(lengths)
    group = num_q_heads // selected.shape[1]

    def tokens_of(b, h):
        out = []
        for j in selected[b, h // group]:
            if j >= 0:
                out += [t for t in range(j * block_size, (j + 1) * block_size) if t < lengths[b]]
        return out

    return tokens_of


def _case(dtype, kv_heads, seed=0):
    """Shuffled pages, garbage (NaN) in every row that no sequence owns."""
    rng = np.random.default_rng(seed)
    rows = (1 + B * MAX_PAGES) * PS
    k = rng.standard_normal((rows, kv_heads, D)).astype(np.float32)
    v = rng.standard_normal((rows, kv_heads, D)).astype(np.float32)
    table = (1 + rng.permutation(B * MAX_PAGES)).reshape(B, MAX_PAGES).astype(np.int32)
    live = np.zeros(rows, bool)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            live[table[b, t // PS] * PS + t % PS] = True
    k[~live] = np.nan  # garbage must never reach the output
    v[~live] = np.nan
    q = rng.standard_normal((B, HQ, D)).astype(np.float32)
    return (
        jnp.asarray(q),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(table),
        jnp.asarray(LENGTHS, jnp.int32),
    )


def _xla_ops():
    """The XLA path, where it exists (another module of this project)."""
    try:
        from jax_sparse_kv.ops import paged_decode
    except ImportError:  # pragma: no cover - the XLA module lands separately
        return None
    return paged_decode


KERNELS = {
    "gpu": (jp.gpu_paged_decode_attention, jp.gpu_sparse_paged_decode_attention, {"splits": 2}),
    "tpu": (jp.tpu_paged_decode_attention, jp.tpu_sparse_paged_decode_attention, {"chunks_per_block": 2}),
}


@pytest.mark.parametrize(
    "platform,dtype,kv_heads",
    [
        pytest.param("gpu", jnp.float32, 2, marks=pytest.mark.slow),
        ("gpu", jnp.bfloat16, 2),
        pytest.param("gpu", jnp.float8_e4m3fn, 2, marks=pytest.mark.slow),
        pytest.param("gpu", jnp.float8_e5m2, 4, marks=pytest.mark.slow),
        pytest.param("tpu", jnp.float32, 2, marks=pytest.mark.slow),
        ("tpu", jnp.bfloat16, 2),
        ("tpu", jnp.float8_e4m3fn, 4),
    ],
)
def test_dense_kernel_matches_reference(platform, dtype, kv_heads):
    q, k, v, table, lengths = _case(dtype, kv_heads)
    dense, _, opts = KERNELS[platform]
    out = dense(q, k, v, table, lengths, page_size=PS, k_scale=0.5, v_scale=2.0, interpret=True, **opts)
    ref = _reference(q, k, v, table, lengths, page_size=PS, k_scale=0.5, v_scale=2.0)
    assert out.shape == (B, HQ, D) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)
    assert not np.any(np.asarray(out[1])), "a zero-length sequence gives zeros"
    xla = _xla_ops()
    if xla is not None:
        want = xla.paged_decode_attention(q, k, v, table, lengths, page_size=PS, k_scale=0.5, v_scale=2.0)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "platform,dtype,block_size",
    [
        ("gpu", jnp.bfloat16, 2 * PS),  # a block is whole pages
        pytest.param("gpu", jnp.float8_e4m3fn, PS // 2, marks=pytest.mark.slow),  # half a page
        pytest.param("tpu", jnp.bfloat16, 2 * PS, marks=pytest.mark.slow),
        ("tpu", jnp.float32, PS // 2),
    ],
)
def test_sparse_kernel_matches_reference(platform, dtype, block_size):
    kv_heads, sel_heads, topk = 2, 4, 3
    q, k, v, table, lengths = _case(dtype, kv_heads, seed=1)
    rng = np.random.default_rng(2)
    num_blocks = MAX_PAGES * PS // block_size
    selected = np.stack([[rng.permutation(num_blocks)[:topk] for _ in range(sel_heads)] for _ in range(B)])
    selected[0, 1, 0] = -1  # "no block"
    selected[2, 3, :] = -1  # a selection with nothing
    selected = jnp.asarray(selected, jnp.int32)
    _, sparse, opts = KERNELS[platform]
    kwargs = dict(page_size=PS, block_size=block_size, k_scale=0.5, v_scale=2.0)
    out = sparse(q, k, v, table, lengths, selected, interpret=True, **kwargs, **opts)
    tokens_of = _sparse_tokens(selected, lengths, block_size, HQ)
    ref = _reference(q, k, v, table, lengths, page_size=PS, k_scale=0.5, v_scale=2.0, tokens_of=tokens_of)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)
    assert not np.any(np.asarray(out[2, 6:])), "heads of an empty selection give zeros"
    xla = _xla_ops()
    if xla is not None:
        want = xla.sparse_paged_decode_attention(q, k, v, table, lengths, selected, **kwargs)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_storage_integers_with_pool_dtype():
    """Pools passed as the cache's storage integers (k_dtype names the dtype) give the same result."""
    q, k, v, table, lengths = _case(jnp.bfloat16, 2)
    as_u16 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    kw = dict(page_size=PS, interpret=True, splits=2)
    a = jp.gpu_paged_decode_attention(q, k, v, table, lengths, **kw)
    b = jp.gpu_paged_decode_attention(
        q, as_u16(k), as_u16(v), table, lengths, k_dtype=jnp.bfloat16, v_dtype=jnp.bfloat16, **kw
    )
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_support_predicates():
    assert jp.gpu_supports(128, 128, 16) and not jp.gpu_supports(96, 128, 16)
    assert jp.tpu_supports(4, 128, 128, 16, jnp.bfloat16)
    assert not jp.tpu_supports(1, 128, 128, 16, jnp.bfloat16)  # one bf16 head fills half a word
    assert not jp.tpu_supports(2, 128, 128, 16, jnp.float8_e4m3fn)
    assert not jp.tpu_supports(4, 64, 64, 16, jnp.bfloat16)


def test_dispatch_on_cpu_is_the_xla_path(monkeypatch):
    """On CPU the dispatched op is the XLA function; forcing XLA changes nothing here."""
    xla = _xla_ops()
    if xla is None:
        pytest.skip("jax_sparse_kv.ops.paged_decode not present")
    q, k, v, table, lengths = _case(jnp.bfloat16, 2)
    want = xla.paged_decode_attention(q, k, v, table, lengths, page_size=PS)
    f = jax.jit(lambda *a: jp.paged_decode_attention(*a, page_size=PS, splits=2))
    np.testing.assert_array_equal(np.asarray(f(q, k, v, table, lengths)), np.asarray(want))
    monkeypatch.setenv(jp.PALLAS_ENV, "0")
    assert not jp.pallas_enabled() and jp.pallas_enabled(True)
    got = jp.paged_decode_attention(q, k, v, table, lengths, page_size=PS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_with_platform_kernels_routes_and_falls_back():
    """Kernel kwargs reach only the kernels; an unsupported shape falls back to XLA."""
    calls = []

    def xla_fn(x, *, scale):
        calls.append("xla")
        return x * scale

    def cuda_fn(x, *, scale, knob=0):
        raise NotImplementedError  # "shape not supported": the XLA path is used for cuda too

    def tpu_fn(x, *, scale, knob=0):
        calls.append(("tpu", knob))
        return x * scale + knob

    fn = jp.with_platform_kernels(xla_fn, cuda=cuda_fn, tpu=tpu_fn)
    x = jnp.arange(4.0)
    out = jax.jit(lambda x: fn(x, scale=2.0, knob=7))(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0) * 2)  # CPU ran the XLA branch
    assert calls == ["xla"]  # a program lowered for CPU traces no kernel
    calls.clear()
    # kernels are traced when a program is lowered for their platform, with the kwargs (a traced scale too)
    exported = export.export(jax.jit(lambda x, s: fn(x, scale=s, knob=7)), platforms=["tpu", "cuda"])(x, 2.0)
    assert ("tpu", 7) in calls and calls.count("xla") == 2  # the reference, and cuda's fallback to it
    assert exported.platforms == ("tpu", "cuda")
    calls.clear()
    fn(x, scale=2.0, knob=7, use_pallas=False)
    assert calls == ["xla"]


def test_platform_switch_picks_by_lowering_platform_and_transforms():
    """`platform.platform_switch`: the CPU function runs here; the program exported for several platforms keeps
    one function each (run here: the CPU one); vmap and jvp go through, outside a mesh and inside one."""
    from jax_sparse_kv import platform

    traced = []

    def switch(x, y, per_device=False):
        def fn(name, factor):
            return lambda t: traced.append(name) or {"out": t["x"] * factor + t["y"], "n": t["n"]}

        return platform.platform_switch(
            {"x": x, "y": y, "n": 3},
            cpu=fn("cpu", 2.0),
            tpu=fn("tpu", 3.0),
            default=fn("default", 5.0),
            per_device=per_device,
        )["out"]

    x, y = jnp.arange(4.0), jnp.float32(1.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(switch)(x, y)), np.arange(4.0) * 2 + 1)
    assert traced == ["cpu"]  # the other platforms' functions are never traced for a CPU program
    exported = export.export(jax.jit(switch), platforms=["cpu", "tpu", "cuda"])(x, y)
    assert sorted(set(traced)) == ["cpu", "default", "tpu"]
    np.testing.assert_array_equal(np.asarray(exported.call(x, y)), np.arange(4.0) * 2 + 1)
    batched = jax.jit(jax.vmap(switch, in_axes=(0, None)))(jnp.ones((3, 4)), y)
    np.testing.assert_array_equal(np.asarray(batched), np.full((3, 4), 3.0))
    _, tangent = jax.jvp(lambda x: switch(x, y), (x,), (jnp.ones(4),))
    np.testing.assert_array_equal(np.asarray(tangent), np.full(4, 2.0))
    traced.clear()
    with jax.set_mesh(jax.make_mesh((1,), ("m",))):  # inside a mesh every function is traced at once
        batched = jax.jit(jax.vmap(lambda x: switch(x, y, per_device=True)))(jnp.ones((3, 4)))
    np.testing.assert_array_equal(np.asarray(batched), np.full((3, 4), 3.0))
    assert sorted(set(traced)) == ["cpu", "default", "tpu"]


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_prefill_queries_as_kernel_rows_equal_the_xla_query_blocks(platform):
    """The ragged path of prefill chunks and verifications on GPU/TPU (`ops.block_sparse.per_query_rows`):
    every query a decode row of the sparse kernel (interpret mode here), with its sequence's pages and
    ``position + 1`` live tokens, gives what the XLA query blocks give; padding queries give zeros."""
    from jax_sparse_kv.ops import paged_decode as xla
    from jax_sparse_kv.ops.block_sparse import per_query_rows

    kv_heads, sel_heads, topk, block_size, q_len = 2, 4, 3, 2 * PS, 5
    q1, k, v, table, lengths = _case(jnp.bfloat16, kv_heads, seed=3)
    rng = np.random.default_rng(4)
    positions = np.stack([np.arange(n - q_len, n) for n in LENGTHS]).astype(np.int32)  # the last q_len tokens
    positions[positions < 0] = -1  # (the zero-length sequence: all padding)
    q = jnp.asarray(rng.standard_normal((B, q_len, HQ, D)), jnp.float32)
    selected = np.full((B, q_len, sel_heads, topk), -1, np.int32)
    for (b, i), p in np.ndenumerate(positions):
        for h in range(sel_heads):
            if p >= 0:
                pick = rng.permutation(p // block_size + 1)[:topk]
                selected[b, i, h, : len(pick)] = pick
    kwargs = dict(page_size=PS, block_size=block_size, k_scale=0.5, v_scale=2.0)
    want = xla.sparse_paged_attention(q, k, v, table, jnp.asarray(positions), jnp.asarray(selected), **kwargs)
    _, sparse, opts = KERNELS[platform]

    def kernel_rows(lengths, q, table, selected):
        return sparse(q, k, v, table, lengths, selected, interpret=True, **kwargs, **opts)

    got = per_query_rows(kernel_rows, q, table, jnp.asarray(positions), jnp.asarray(selected), MAX_PAGES * PS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)).sum() > 0 and not np.asarray(got)[positions < 0].any()


@pytest.mark.parametrize(
    "platform,dtype,rows_per_program",
    [
        ("gpu", jnp.bfloat16, 16),
        ("tpu", jnp.bfloat16, 256),
        pytest.param("gpu", jnp.float8_e4m3fn, 64, marks=pytest.mark.slow),
        pytest.param("tpu", jnp.float32, 8, marks=pytest.mark.slow),
    ],
)
def test_query_block_kernel_equals_the_xla_query_blocks(platform, dtype, rows_per_program):
    """The dense query-block kernels (`gpu_paged_attention` / `tpu_paged_attention`, interpret mode): prefill
    chunks and verifications, each block's queries at consecutive positions, some of them padding, give what
    the XLA path (`ops.paged_decode.paged_attention`) gives, and a float64 reference of causal attention; tiles
    of a few queries per program (small `rows_per_program`) give the same. Unowned rows hold NaN."""
    from jax_sparse_kv.ops import paged_decode as xla

    kv_heads, q_len = 2, 7
    _, k, v, table, _ = _case(dtype, kv_heads, seed=5)
    rng = np.random.default_rng(6)
    positions = np.stack([np.arange(n - q_len, n) for n in LENGTHS]).astype(np.int32)  # each block's last tokens
    positions[positions < 0] = -1  # the zero-length sequence: all padding
    positions[2, -2:] = -1  # padding queries after a block's last real one (a bucket's tail)
    q = jnp.asarray(rng.standard_normal((B, q_len, HQ, D)), jnp.float32)
    kwargs = dict(page_size=PS, k_scale=0.5, v_scale=2.0)
    kernel = {"gpu": jp.gpu_paged_attention, "tpu": jp.tpu_paged_attention}[platform]
    got = kernel(q, k, v, table, jnp.asarray(positions), interpret=True, rows_per_program=rows_per_program, **kwargs)
    want = xla.paged_attention(q, k, v, table, jnp.asarray(positions), **kwargs)
    assert got.shape == (B, q_len, HQ, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    for i in range(q_len):  # the reference: query i of block b sees tokens [0, position + 1)
        lengths = np.maximum(positions[:, i] + 1, 0)
        ref = _reference(q[:, i], k, v, table, lengths, page_size=PS, k_scale=0.5, v_scale=2.0)
        np.testing.assert_allclose(np.asarray(got[:, i]), ref, atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)).sum() > 0 and not np.asarray(got)[positions < 0].any()
