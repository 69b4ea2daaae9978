"""The chunked paged ops against the slow reference (tests/support/reference_ops.py), and their memory behaviour."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import reference_ops as ref
from support.common import compile_as_users_do

from jax_sparse_kv import ops
from jax_sparse_kv.ops import paged_decode as pd
from jax_sparse_kv.storage import storage_dtype

PAGE, HKV, D, DV = 4, 2, 8, 6
LENGTHS = np.array([37, 0, 13, 4, 25], np.int32)  # different lengths, a padding sequence, a one-page sequence
WIDTH = 12  # pages per sequence in the table (48 tokens): wider than any sequence needs
DTYPES = {
    "f32": (jnp.float32, 1.0),
    "bf16": (jnp.bfloat16, 1.0),
    "fp8_e4m3": (jnp.float8_e4m3fn, 0.25),
    "fp8_e5m2": (jnp.float8_e5m2, 2.0),
}


def rand(seed, shape):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def shuffled_table(seed, lengths=LENGTHS, width=WIDTH):
    """Each sequence's live pages at shuffled page ids; padding page 0 past them."""
    rng = np.random.default_rng(seed)
    need = [-(-int(n) // PAGE) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(need) + 4))  # a few unused pages too
    table, start = np.zeros((len(lengths), width), np.int32), 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start : start + n]
        start += n
    return table, len(ids) + 1


def pool(seed, num_pages, heads, dim, dtype, scale, table, lengths=LENGTHS):
    """A pool of `dtype` holding scaled random rows at live tokens, NaN / inf garbage everywhere else."""
    values = rand(seed, (num_pages * PAGE, heads, dim)) / scale
    live = np.zeros(num_pages * PAGE, bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            live[table[b, t // PAGE] * PAGE + t % PAGE] = True
    garbage = np.where(np.arange(num_pages * PAGE) % 2, np.nan, np.inf)[:, None, None]
    values = np.where(live[:, None, None], values, garbage)
    return jnp.asarray(values).astype(dtype)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(d, marks=pytest.mark.slow) if d == "f32" else d for d in DTYPES],  # f32: ~15 s; bf16/fp8 stay
    ids=list(DTYPES),
)
def test_dense_decode_matches_reference(dtype):
    dt, scale = DTYPES[dtype]
    table, pages = shuffled_table(0)
    k, v = pool(1, pages, HKV, D, dt, scale, table), pool(2, pages, HKV, DV, dt, scale, table)
    q = jnp.asarray(rand(3, (len(LENGTHS), 3 * HKV, D)))
    pos = jnp.asarray(LENGTHS - 1)[:, None]
    want = ref.dense_attention(
        q[:, None],
        ops.PagedKV(k, jnp.asarray(table), PAGE, scale),
        ops.PagedKV(v, jnp.asarray(table), PAGE, scale),
        pos,
    )[:, 0]
    assert np.isfinite(np.asarray(want)).all()
    for chunk in (1, 2, 5):  # one page per step, several, a chunk that does not divide the table
        got = ops.paged_decode_attention(
            q,
            k,
            v,
            jnp.asarray(table),
            jnp.asarray(LENGTHS),
            page_size=PAGE,
            k_scale=scale,
            v_scale=scale,
            pages_per_chunk=chunk,
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    assert not np.asarray(got)[1].any()  # the padding sequence reads nothing
    # storage integers plus the dtype (as the cache holds pools) give the same result
    stored = [jax.lax.bitcast_convert_type(x, storage_dtype(dt)) for x in (k, v)]
    got = ops.paged_decode_attention(
        q,
        *stored,
        jnp.asarray(table),
        jnp.asarray(LENGTHS),
        page_size=PAGE,
        k_scale=scale,
        v_scale=scale,
        k_dtype=dt,
        v_dtype=dt,
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # the op behind the public API, through PagedKV sources (storage form too)
    got = ops.dense_attention(
        q[:, None],
        ops.PagedKV(stored[0], jnp.asarray(table), PAGE, scale, dtype=dt),
        ops.PagedKV(stored[1], jnp.asarray(table), PAGE, scale, dtype=dt),
        pos,
    )[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_dense_prefill_matches_reference_with_query_blocks(monkeypatch):
    """Causal prefill over several chunks, queries split into blocks, padding queries, a chunked-prefill offset."""
    table, pages = shuffled_table(4)
    k, v = pool(5, pages, HKV, D, jnp.bfloat16, 1.0, table), pool(6, pages, HKV, DV, jnp.bfloat16, 1.0, table)
    q_len = 16
    q = jnp.asarray(rand(7, (len(LENGTHS), q_len, 2 * HKV, D)))
    # the last min(n, q_len) tokens of each sequence are this call's queries; the rest is padding
    pos = np.full((len(LENGTHS), q_len), -1, np.int32)
    for b, n in enumerate(LENGTHS):
        m = min(int(n), q_len)
        pos[b, :m] = np.arange(n - m, n)
    src = [ops.PagedKV(x, jnp.asarray(table), PAGE) for x in (k, v)]
    want = np.asarray(ref.dense_attention(q, *src, jnp.asarray(pos)))
    monkeypatch.setattr(pd, "DENSE_CHUNK_TOKENS", 2 * PAGE)
    monkeypatch.setattr(pd, "SCORE_BUDGET_BYTES", 4 * (2 * HKV) * 5 * 2 * PAGE)  # query blocks of 5
    got = np.asarray(ops.dense_attention(q, *src, jnp.asarray(pos)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not got[pos < 0].any()


@pytest.mark.parametrize(
    "block",
    [pytest.param(8, marks=pytest.mark.slow), 4, 2, 6],  # block=2pages: ~11 s, the other block sizes stay
    ids=["block=2pages", "block=page", "block<page", "block=1.5pages"],
)
def test_block_scores_match_reference(block, monkeypatch):
    table, pages = shuffled_table(8)
    ik = pool(9, pages, 1, D, jnp.bfloat16, 0.5, table)
    iq = jnp.asarray(rand(10, (len(LENGTHS), 3, 4, D)))
    pos = jnp.asarray(np.stack([LENGTHS - 1, LENGTHS // 2, np.minimum(LENGTHS, 2) - 1], axis=1))
    src = ops.PagedKV(ik, jnp.asarray(table), PAGE, 0.5)
    want = np.asarray(ref.block_scores(iq, src, pos, block))
    monkeypatch.setattr(pd, "SCORE_CHUNK_TOKENS", 2 * PAGE)  # several chunks per sequence
    got = np.asarray(ops.block_scores(iq, src, pos, block))
    assert got.shape == want.shape == (len(LENGTHS), 3, 4, -(-WIDTH * PAGE // block))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # -inf where the block has no token <= position


def selection(seed, lengths, q_len, sel_heads, topk, block):
    """Random distinct blocks at or before each query's block, -1 padded."""
    rng = np.random.default_rng(seed)
    sel = np.full((len(lengths), q_len, sel_heads, topk), -1, np.int32)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        last = (n - 1) // block
        for h in range(sel_heads):
            pick = rng.permutation(last + 1)[:topk]
            sel[b, 0, h, : len(pick)] = pick
    return sel


@pytest.mark.parametrize(
    "dtype, block, sel_heads",
    [
        pytest.param("bf16", 8, HKV, marks=pytest.mark.slow),  # 3 s: fp8 takes blocks of two pages by default
        ("fp8_e4m3", 8, 2 * HKV),
        ("bf16", 4, 2 * HKV),
        ("f32", 2, HKV),
        ("fp8_e4m3", 6, 2 * HKV),
    ],
    ids=[
        "bf16-block=2pages",
        "fp8-block=2pages-sel=2kv",
        "bf16-block=page-sel=2kv",
        "f32-block<page",
        "fp8-block=1.5pages-sel=2kv",
    ],
)
def test_sparse_decode_matches_reference(dtype, block, sel_heads):
    dt, scale = DTYPES[dtype]
    table, pages = shuffled_table(11)
    k, v = pool(12, pages, HKV, D, dt, scale, table), pool(13, pages, HKV, DV, dt, scale, table)
    q = jnp.asarray(rand(14, (len(LENGTHS), 4 * HKV, D)))
    sel = jnp.asarray(selection(15, LENGTHS, 1, sel_heads, 3, block))
    pos = jnp.asarray(LENGTHS - 1)[:, None]
    src = [ops.PagedKV(x, jnp.asarray(table), PAGE, scale) for x in (k, v)]
    want = np.asarray(ref.block_sparse_attention(q[:, None], *src, pos, sel, block))[:, 0]
    assert np.isfinite(want).all() and not want[1].any()
    got = ops.sparse_paged_decode_attention(
        q,
        k,
        v,
        jnp.asarray(table),
        jnp.asarray(LENGTHS),
        sel[:, 0],
        page_size=PAGE,
        block_size=block,
        k_scale=scale,
        v_scale=scale,
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    got = ops.block_sparse_attention(q[:, None], *src, pos, sel, block)[:, 0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


def test_sel_heads_split_query_heads_evenly():
    """Query head h uses selection h // (Hq / sel_heads): selecting block j only for one selection head
    changes exactly that head group's output."""
    lengths = np.array([24], np.int32)
    table, pages = shuffled_table(16, lengths, width=6)
    k, v = (
        pool(17, pages, HKV, D, jnp.float32, 1.0, table, lengths),
        pool(18, pages, HKV, DV, jnp.float32, 1.0, table, lengths),
    )
    q = jnp.asarray(rand(19, (1, 8, D)))
    base = np.array([[[5, -1]] * 4], np.int32)  # 4 selection heads over 2 KV heads, 8 query heads
    other = base.copy()
    other[0, 2, 1] = 1  # selection head 2 also reads block 1

    def run(s):
        out = ops.sparse_paged_decode_attention(
            q, k, v, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(s), page_size=PAGE, block_size=PAGE
        )
        return np.asarray(out)

    a, b = run(base), run(other)
    changed = np.abs(a - b).max(axis=-1)[0] > 1e-6
    assert changed.tolist() == [False, False, False, False, True, True, False, False]


@pytest.mark.slow  # 5-10 s: contiguous sources; test_ops checks them against a naive reference too
def test_contiguous_sources_match_reference():
    q = jnp.asarray(rand(20, (2, 9, 4, D)))
    k, v = jnp.asarray(rand(21, (2, 9, 2, D))), jnp.asarray(rand(22, (2, 9, 2, DV)))
    pos = jnp.asarray([np.arange(9), np.r_[np.arange(6), [-1] * 3]], jnp.int32)
    src = [ops.ContiguousKV(k), ops.ContiguousKV(v)]
    np.testing.assert_allclose(
        np.asarray(ops.dense_attention(q, *src, pos)),
        np.asarray(ref.dense_attention(q, *src, pos)),
        rtol=2e-5,
        atol=2e-6,
    )
    sel = jnp.asarray(np.broadcast_to(np.array([0, 2, -1], np.int32), (2, 9, 2, 3)))
    np.testing.assert_allclose(
        np.asarray(ops.block_sparse_attention(q, *src, pos, sel, 4)),
        np.asarray(ref.block_sparse_attention(q, *src, pos, sel, 4)),
        rtol=2e-5,
        atol=2e-6,
    )


# ------------------------------------------------------------------- memory

BIG_PAGE, BIG_HEADS, BIG_DIM, Q_HEADS, INDEX_HEADS = 128, 4, 128, 16, 4


def _decode_step_temp_bytes(kind: str, batch: int, width_tokens: int, fn_ops=ops) -> int:
    """Temp bytes of one compiled decode step over a 64K-token-per-sequence bf16 pool and a table `width_tokens` wide."""
    rows = batch * 65536 + BIG_PAGE
    kv = jax.ShapeDtypeStruct((rows, BIG_HEADS, BIG_DIM), jnp.uint16)
    ik = jax.ShapeDtypeStruct((rows, 1, BIG_DIM), jnp.uint16)
    table = jax.ShapeDtypeStruct((batch, width_tokens // BIG_PAGE), jnp.int32)
    q = jax.ShapeDtypeStruct((batch, 1, Q_HEADS, BIG_DIM), jnp.float32)
    iq = jax.ShapeDtypeStruct((batch, 1, INDEX_HEADS, BIG_DIM), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32)

    def step(k, v, ik, q, iq, pos, table):
        src = lambda buf: ops.PagedKV(buf, table, BIG_PAGE, dtype=jnp.bfloat16)  # noqa: E731
        if kind == "dense":
            return fn_ops.dense_attention(q, src(k), src(v), pos)
        scores = fn_ops.block_scores(iq, src(ik), pos, BIG_PAGE)
        sel = ops.select_blocks(scores, pos, BIG_PAGE, 16)
        return fn_ops.block_sparse_attention(q, src(k), src(v), pos, sel, BIG_PAGE)

    compiled = compile_as_users_do(jax.jit(step).lower(kv, kv, ik, q, iq, pos, table))
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 8])  # batch 1: 3 s, the same bound
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_decode_temp_memory_does_not_grow_with_table_width(kind, batch):
    narrow = _decode_step_temp_bytes(kind, batch, 4096)
    wide = _decode_step_temp_bytes(kind, batch, 65536)
    # Per-sequence block scores [index_heads, blocks] and the page table grow with the width: bytes, not MiB.
    assert wide <= narrow + batch * 16 * 1024, (narrow, wide)
    kv_bytes_64k = batch * 65536 * BIG_HEADS * BIG_DIM * 2 * 2
    assert wide < 16 << 20 and wide < kv_bytes_64k // 8, (wide, kv_bytes_64k)


def test_reference_temp_memory_grows_with_table_width():
    """What the bound above rules out: the slow reference gathers the whole table width in f32."""
    narrow = _decode_step_temp_bytes("dense", 1, 4096, fn_ops=ref)
    wide = _decode_step_temp_bytes("dense", 1, 65536, fn_ops=ref)
    assert wide > 10 * narrow and wide > 64 << 20, (narrow, wide)


@pytest.mark.slow  # ~15 s: a variant of the paged reference checks that stay
def test_positions_past_the_table_attend_to_the_whole_table_only():
    """A query beyond the table's width sees every tabled token; the padding page (NaN here) never leaks."""
    lengths = np.array([8], np.int32)
    table, pages = shuffled_table(23, lengths, width=2)
    k, v = (
        pool(24, pages, HKV, D, jnp.bfloat16, 1.0, table, lengths),
        pool(25, pages, HKV, DV, jnp.bfloat16, 1.0, table, lengths),
    )
    q = jnp.asarray(rand(26, (1, 4, 2 * HKV, D)))
    q = q.at[:, 3].set(q[:, 1])
    pos = jnp.asarray([[3, 7, 8, 40]], jnp.int32)
    src = [ops.PagedKV(x, jnp.asarray(table), PAGE) for x in (k, v)]
    want = np.asarray(ref.dense_attention(q, *src, pos))
    got = np.asarray(ops.dense_attention(q, *src, pos))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[0, 3], got[0, 1], rtol=1e-6)  # position 40 = the whole table = position 7


def prefill_selection(seed, positions, sel_heads, topk, block):
    """Random distinct blocks at or before each query's own block, -1 padded; none for padding queries."""
    rng = np.random.default_rng(seed)
    sel = np.full(positions.shape + (sel_heads, topk), -1, np.int32)
    for (b, i), p in np.ndenumerate(positions):
        if p < 0:
            continue
        for h in range(sel_heads):
            pick = rng.permutation(p // block + 1)[:topk]
            sel[b, i, h, : len(pick)] = pick
    return sel


@pytest.mark.parametrize("path", ["union", "query_by_query"])
@pytest.mark.parametrize(
    "dtype, block, sel_heads",
    [
        pytest.param("bf16", 8, HKV, marks=pytest.mark.slow),  # 11 s a path: fp8 runs the same prefill paths
        ("fp8_e4m3", 6, 2 * HKV),
        pytest.param("f32", 2, 2 * HKV, marks=pytest.mark.slow),  # ~10 s a path: fp8 runs the same prefill paths
    ],
    ids=["bf16-block=2pages", "fp8-block=1.5pages-sel=2kv", "f32-block<page-sel=2kv"],
)
def test_sparse_prefill_matches_reference(dtype, block, sel_heads, path, monkeypatch):
    """Prefill takes queries in blocks: the union of their selections read once (each query masked to its
    own blocks), or query by query when the union is large. Both equal the reference."""
    monkeypatch.setattr(pd, "UNION_LIMIT", 10**6 if path == "union" else 0)
    monkeypatch.setattr(pd, "_query_blocks", lambda q_len, rows, tokens: 4)  # 3 query blocks per sequence, one padded
    dt, scale = DTYPES[dtype]
    table, pages = shuffled_table(31)
    k, v = pool(32, pages, HKV, D, dt, scale, table), pool(33, pages, HKV, DV, dt, scale, table)
    q_len = 11
    # the last q_len tokens of each sequence; shorter sequences padded with -1 in front
    positions = np.stack([np.arange(n - q_len, n) for n in LENGTHS]).astype(np.int32)
    positions[positions < 0] = -1
    q = jnp.asarray(rand(34, (len(LENGTHS), q_len, 4 * HKV, D)))
    sel = jnp.asarray(prefill_selection(35, positions, sel_heads, 3, block))
    pos = jnp.asarray(positions)
    src = [ops.PagedKV(x, jnp.asarray(table), PAGE, scale) for x in (k, v)]
    want = np.asarray(ref.block_sparse_attention(q, *src, pos, sel, block))
    assert np.isfinite(want).all() and not want[positions < 0].any()
    got = np.asarray(ops.block_sparse_attention(q, *src, pos, sel, block))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------ rows: serial on CPU, vectorized on GPU/TPU


def _row_cases():
    """``{op: fn(rows=...)}``: dense prefill, block scores, sparse prefill and sparse decode over ragged
    sequences (a padding one, garbage past each sequence's tokens), query blocks of 4 (several per sequence)."""
    table, pages = shuffled_table(40)
    k, v = pool(41, pages, HKV, D, jnp.bfloat16, 1.0, table), pool(42, pages, HKV, DV, jnp.bfloat16, 1.0, table)
    ik = pool(43, pages, 1, D, jnp.bfloat16, 0.5, table)
    q_len = 11
    positions = np.stack([np.arange(n - q_len, n) for n in LENGTHS]).astype(np.int32)
    positions[positions < 0] = -1
    pos, tab = jnp.asarray(positions), jnp.asarray(table)
    q = jnp.asarray(rand(44, (len(LENGTHS), q_len, 4 * HKV, D)))
    iq = jnp.asarray(rand(45, (len(LENGTHS), q_len, 4, D)))
    sel = jnp.asarray(prefill_selection(46, positions, 2 * HKV, 3, 8))
    dec_sel = jnp.asarray(selection(47, LENGTHS, 1, HKV, 3, 4))[:, 0]
    lengths = jnp.asarray(LENGTHS)
    kw = dict(page_size=PAGE)
    return {
        "dense prefill": lambda rows: pd.paged_attention(q, k, v, tab, pos, pages_per_chunk=2, rows=rows, **kw),
        "block scores": lambda rows: pd.paged_block_scores(
            iq, ik, tab, pos, block_size=8, k_scale=0.5, pages_per_chunk=2, rows=rows, **kw
        ),
        "sparse prefill": lambda rows: pd.sparse_paged_attention(q, k, v, tab, pos, sel, block_size=8, rows=rows, **kw),
        "sparse decode": lambda rows: pd.sparse_paged_attention(
            q[:, :1], k, v, tab, (lengths - 1)[:, None], dec_sel[:, None], block_size=4, rows=rows, **kw
        ),
        # a verification's row: a sequence's last 5 tokens as one row of queries
        "sparse verification": lambda rows: pd.sparse_paged_attention(
            q[:, -5:], k, v, tab, pos[:, -5:], sel[:, -5:], block_size=8, rows=rows, **kw
        ),
    }


@pytest.mark.parametrize(
    "op", ["dense prefill", "block scores", "sparse prefill", "sparse decode", "sparse verification"]
)
def test_vectorized_rows_equal_serial_rows(op, monkeypatch):
    """All rows at once (a static loop over the table's chunks, or over each query's selected blocks) gives the
    serial path's values, which the tests above hold to the reference; padding queries stay zero. On CPU
    (``rows=None``) sparse decode and rows of at most `CPU_VECTOR_QUERIES` queries (a verification's) take the
    vectorized rows, everything else the serial ones."""
    monkeypatch.setattr(pd, "_query_blocks", lambda q_len, rows, tokens: 4)
    monkeypatch.setattr(pd, "VECTOR_SPARSE_TOKENS", 8)  # several loop steps per query
    fn = _row_cases()[op]
    serial, vectorized = np.asarray(fn("serial")), np.asarray(fn("vectorized"))
    assert (np.isfinite(serial) & (serial != 0)).sum() > serial.size // 4  # values to compare, not padding
    np.testing.assert_allclose(vectorized, serial, rtol=2e-5, atol=2e-6)
    # lowered for CPU: decode and verification queries of sparse attention all at once, the rest serial
    expected = vectorized if op in ("sparse decode", "sparse verification") else serial
    assert np.asarray(fn(None)).tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="rows must be"):
        fn("rowwise")


def test_default_chunks_never_read_past_the_table():
    """A loop step reads ~1024 tokens (dense) or ~4096 (index scores), but never more than half the table
    (dense) or the table (index, in whole blocks): a step's table follows its live context, and a wider chunk
    would read padding pages."""
    assert pd._chunk_pages(None, 16, pd.DENSE_CHUNK_TOKENS, width=16, parts=2) == 8
    assert pd._chunk_pages(None, 16, pd.DENSE_CHUNK_TOKENS, width=1024, parts=2) == 64
    assert pd._chunk_pages(None, 16, pd.DENSE_CHUNK_TOKENS, width=1, parts=2) == 1
    assert pd._chunk_pages(None, 16, pd.SCORE_CHUNK_TOKENS, 2, width=16) == 16  # blocks of 2 pages
    assert pd._chunk_pages(None, 16, pd.SCORE_CHUNK_TOKENS, 2, width=15) == 16  # rounded up to whole blocks
    assert pd._chunk_pages(None, 16, pd.SCORE_CHUNK_TOKENS, 2, width=4096) == 256
    assert pd._chunk_pages(3, 16, pd.DENSE_CHUNK_TOKENS, width=16) == 3  # asked for: as asked
    with pytest.raises(ValueError, match="positive multiple of 2"):
        pd._chunk_pages(3, 16, pd.SCORE_CHUNK_TOKENS, 2, width=16)


def _loops(text: str) -> int:
    return len(re.findall(r"stablehlo\.while", text))


@pytest.mark.parametrize("op", ["dense prefill", "block scores", "sparse prefill"])
def test_gpu_and_tpu_programs_have_no_loop_over_rows(op):
    """Lowered for cuda and tpu (from this CPU) each op is one loop (over chunks or selected blocks), all rows
    inside it; lowered for CPU it keeps the loop over rows around it (each row reads its live pages only)."""
    from jax import export

    fn = _row_cases()[op]
    cpu = _loops(jax.jit(lambda: fn(None)).lower().as_text())
    for platform in ("cuda", "tpu"):
        text = export.export(jax.jit(lambda: fn(None)), platforms=[platform])().mlir_module()
        assert _loops(text) == 1, (platform, _loops(text))
    assert cpu >= 2
