"""Reference ops against straightforward NumPy loops, on contiguous and paged sources."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_kv import ops

B, T, HKV, G, D, DV, PAGE = 2, 16, 2, 3, 8, 5, 4


def rand(seed, shape):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def naive_attention(q, k, v, qpos, allowed=None):
    """q [b,q,Hq,D], k [b,T,Hkv,D]; allowed(b, qi, h, t) -> bool extra mask."""
    b_, ql, hq, d = q.shape
    hkv = k.shape[2]
    out = np.zeros((b_, ql, hq, v.shape[-1]), np.float32)
    for b in range(b_):
        for i in range(ql):
            p = qpos[b, i]
            if p < 0:
                continue
            for h in range(hq):
                kh = h // (hq // hkv)
                ts = [t for t in range(p + 1) if allowed is None or allowed(b, i, kh, t)]
                if not ts:
                    continue
                s = np.array([q[b, i, h] @ k[b, t, kh] for t in ts]) / np.sqrt(d)
                w = np.exp(s - s.max())
                w /= w.sum()
                out[b, i, h] = sum(wi * v[b, t, kh] for wi, t in zip(w, ts, strict=True))
    return out


def paged(values, page_table, num_rows):
    """Scatter contiguous [b, T, H, D] into a buffer through a page table."""
    buf = np.full((num_rows,) + values.shape[2:], np.nan, np.float32)  # garbage everywhere else
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            buf[page_table[b, t // PAGE] * PAGE + t % PAGE] = values[b, t]
    return buf


PAGE_TABLE = np.array([[1, 3, 5, 7], [2, 4, 6, 8]], np.int32)  # interleaved pages
NUM_ROWS = 9 * PAGE


def sources(values):
    return [
        ops.ContiguousKV(jnp.asarray(values)),
        ops.PagedKV(jnp.asarray(paged(values, PAGE_TABLE, NUM_ROWS)), jnp.asarray(PAGE_TABLE), PAGE),
    ]


def test_token_slots():
    pos = jnp.array([[0, 5, -1, 15, 16], [3, 4, 8, 99, 12]])
    got = np.asarray(ops.token_slots(jnp.asarray(PAGE_TABLE), pos, PAGE))
    np.testing.assert_array_equal(got, [[4, 13, 0, 31, 0], [11, 16, 24, 0, 32]])


@pytest.mark.parametrize(
    "source",
    [pytest.param(0, marks=pytest.mark.slow), 1],  # contiguous: ~12 s; the paged case stays
    ids=["contiguous", "paged"],
)
def test_dense_attention_prefill_and_decode(source):
    q = rand(0, (B, T, HKV * G, D))
    k, v = rand(1, (B, T, HKV, D)), rand(2, (B, T, HKV, DV))
    qpos = np.array([np.arange(T), np.r_[np.arange(11), [-1] * 5]], np.int32)  # second sequence padded
    ks, vs = sources(k)[source], sources(v)[source]
    got = ops.dense_attention(jnp.asarray(q), ks, vs, jnp.asarray(qpos))
    np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v, qpos), rtol=1e-5, atol=1e-5)
    # decode: one query token per sequence at different positions
    dpos = np.array([[15], [9]], np.int32)
    got = ops.dense_attention(jnp.asarray(q[:, :1]), ks, vs, jnp.asarray(dpos))
    np.testing.assert_allclose(np.asarray(got), naive_attention(q[:, :1], k, v, dpos), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_block_scores_and_selection():
    block = 4
    iq, ik = rand(3, (B, T, 2, D)), rand(4, (B, T, 1, D))
    qpos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    scores = np.asarray(ops.block_scores(jnp.asarray(iq), ops.ContiguousKV(jnp.asarray(ik)), jnp.asarray(qpos), block))
    for b, i, h, j in [(0, 5, 1, 0), (1, 15, 0, 3), (0, 9, 0, 2), (1, 2, 1, 1)]:
        ts = [t for t in range(j * block, (j + 1) * block) if t <= qpos[b, i]]
        want = max(iq[b, i, h] @ ik[b, t, 0] for t in ts) if ts else -np.inf
        np.testing.assert_allclose(scores[b, i, h, j], want, rtol=1e-5)


def test_select_blocks_forced_topk_and_padding():
    # one sequence, one head; 6 blocks of 4; query at position 21 (block 5)
    scores = jnp.array([[[[0.0, 9.0, 1.0, 8.0, 7.0, -5.0]]]])
    sel = ops.select_blocks(scores, jnp.array([[21]]), block_size=4, topk=4, init_blocks=1, local_blocks=1)
    assert sorted(np.asarray(sel).ravel().tolist()) == [0, 1, 3, 5]  # init 0, local 5, best of the rest: 1, 3
    # query at position 5 (block 1): only blocks 0, 1 are candidates -> -1 padding
    sel = ops.select_blocks(scores, jnp.array([[5]]), block_size=4, topk=4, init_blocks=0, local_blocks=1)
    assert sorted(np.asarray(sel).ravel().tolist()) == [-1, -1, 0, 1]
    # padding query selects nothing
    sel = ops.select_blocks(scores, jnp.array([[-1]]), block_size=4, topk=3)
    assert np.asarray(sel).ravel().tolist() == [-1, -1, -1]
    # local_blocks=2 forces the previous block even with the lowest score
    sel = ops.select_blocks(scores, jnp.array([[23]]), block_size=4, topk=3, init_blocks=0, local_blocks=2)
    assert sorted(np.asarray(sel).ravel().tolist()) == [1, 4, 5]
    with pytest.raises(ValueError, match="topk=1 must be >= init_blocks"):
        ops.select_blocks(scores, jnp.array([[5]]), block_size=4, topk=1, init_blocks=1, local_blocks=1)


def test_index_heads_merged_per_kv_head():
    iq, ik = rand(5, (1, 1, 4, D)), rand(6, (1, T, 1, D))
    src = ops.ContiguousKV(jnp.asarray(ik))
    qpos = jnp.array([[T - 1]])
    scores = np.asarray(ops.block_scores(jnp.asarray(iq), src, qpos, 4))[0, 0]  # [4 heads, 4 blocks]
    sel = np.asarray(ops.indexer_select(jnp.asarray(iq), src, qpos, kv_heads=2, block_size=4, topk=2))[0, 0]
    for h in range(2):
        merged = scores[2 * h : 2 * h + 2].max(axis=0)
        best_other = int(np.argmax(merged[:3]))  # block 3 is local (forced)
        assert sorted(sel[h].tolist()) == sorted([3, best_other])


@pytest.mark.parametrize("source", [0, 1], ids=["contiguous", "paged"])
def test_block_sparse_attention_matches_naive(source):
    block, topk = 4, 2
    q = rand(7, (B, T, HKV * G, D))
    k, v = rand(8, (B, T, HKV, D)), rand(9, (B, T, HKV, DV))
    qpos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    iq, ik = rand(10, (B, T, 2, D)), rand(11, (B, T, 1, D))
    sel = ops.indexer_select(jnp.asarray(iq), sources(ik)[source], jnp.asarray(qpos), HKV, block, topk)
    got = ops.block_sparse_attention(
        jnp.asarray(q), sources(k)[source], sources(v)[source], jnp.asarray(qpos), sel, block
    )
    s = np.asarray(sel)
    want = naive_attention(q, k, v, qpos, allowed=lambda b, i, h, t: (t // block) in s[b, i, h])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert (s >= 0).sum() > 0 and (s[:, 8:] >= 0).all()  # late tokens fill all topk slots


def test_block_sparse_with_every_block_selected_is_dense():
    q = rand(12, (B, T, HKV * G, D))
    k, v = rand(13, (B, T, HKV, D)), rand(14, (B, T, HKV, DV))
    qpos = jnp.tile(jnp.arange(T), (B, 1))
    every = jnp.broadcast_to(jnp.arange(4), (B, T, HKV, 4))
    ks, vs = ops.ContiguousKV(jnp.asarray(k)), ops.ContiguousKV(jnp.asarray(v))
    np.testing.assert_allclose(
        np.asarray(ops.block_sparse_attention(jnp.asarray(q), ks, vs, qpos, every, 4)),
        np.asarray(ops.dense_attention(jnp.asarray(q), ks, vs, qpos)),
        rtol=1e-5,
        atol=1e-6,
    )
