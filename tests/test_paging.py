"""Paging: the host allocator, the on-device page table, moves, offload, stages, checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.common import DTYPES, bits, small_layout

import jax_sparse_kv as jsk
from jax_sparse_kv.checkpoint import restore_cache, save_cache
from jax_sparse_kv.errors import AllocatorError, LayoutError, NotLocalLayerError, OutOfCapacityError
from jax_sparse_kv.nn import DecodeSession, KVPrecision, MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.nn.decode import make_device_loop, pad_prompts
from jax_sparse_kv.paging import FreePages, PageAllocator, PageTable, release_pages, reserve_pages

# ----------------------------------------------------------------- allocator


def test_allocator_alloc_free_and_counts():
    alloc = PageAllocator(num_pages=4, page_size=8)
    assert alloc.available == 4 and alloc.available_tokens == 32
    slots = alloc.alloc(10)  # two pages
    np.testing.assert_array_equal(slots, np.r_[8:16, 16:18])
    assert alloc.available == 2
    assert (slots >= 8).all()  # never the padding page
    alloc.free(slots)
    assert alloc.available == 4
    assert alloc.alloc(0).shape == (0,)


def test_allocator_exhaustion_leaves_state_unchanged():
    alloc = PageAllocator(num_pages=3, page_size=4)
    first = alloc.alloc_pages(2)
    with pytest.raises(OutOfCapacityError, match="out of capacity: asked for 2 pages, 1 free of 3"):
        alloc.alloc(5)
    assert alloc.available == 1
    alloc.free_pages(first)
    assert sorted(alloc.alloc_pages(3).tolist()) == [1, 2, 3]


def test_allocator_misuse():
    alloc = PageAllocator(num_pages=3, page_size=4)
    pages = alloc.alloc_pages(2)
    alloc.free_pages(pages[:1])
    with pytest.raises(AllocatorError, match=r"double free of pages \[1\]"):
        alloc.free_pages(pages[:1])
    with pytest.raises(AllocatorError, match=r"double free of pages \[2\]"):
        alloc.free_pages([2, 2])
    assert alloc.available == 2  # the failed frees changed nothing
    with pytest.raises(AllocatorError, match="padding page"):
        alloc.free_pages([0])
    with pytest.raises(AllocatorError, match="padding page"):
        alloc.free([1, 2])
    with pytest.raises(AllocatorError, match=r"out of range 1..3"):
        alloc.free_pages([7])
    with pytest.raises(AllocatorError, match="non-negative int"):
        alloc.alloc(-1)
    assert PageAllocator.for_layout(small_layout()).available == 4


# ---------------------------------------------------------------- page table


def test_reserve_and_release_never_share_pages():
    rng = np.random.default_rng(0)
    batch, max_pages, num_pages, ps = 4, 6, 12, 4
    table, free = PageTable.empty(batch, max_pages, ps), FreePages.full(num_pages)
    reserve = jax.jit(reserve_pages, static_argnums=3)
    release = jax.jit(release_pages)
    for _ in range(60):
        if rng.random() < 0.2:
            table, free = release(table, free, jnp.asarray(rng.random(batch) < 0.5))
        else:
            n = jnp.asarray(rng.integers(0, 6, batch), jnp.int32)
            new_table, new_free, ok = reserve(table, free, n, 2)
            if bool(ok):
                table, free = new_table.advance(n), new_free
            else:  # nothing reserved on failure
                np.testing.assert_array_equal(new_table.pages, table.pages)
                assert int(new_free.count) == int(free.count)
        pages = np.asarray(table.pages)
        used = pages[pages != 0]
        assert len(used) == len(set(used.tolist())), "a page is owned by two sequences"
        free_set = set(np.asarray(free.stack)[: int(free.count)].tolist())
        assert not free_set & set(used.tolist()), "an owned page is on the free stack"
        assert len(free_set) + len(used) == num_pages
        lengths = np.asarray(table.lengths)
        np.testing.assert_array_equal((pages != 0).sum(1), -(-lengths // ps))


def test_page_table_slots_and_padding():
    table = PageTable(jnp.array([[3, 1, 0], [2, 0, 0]], jnp.int32), jnp.array([5, 2], jnp.int32), 4)
    pos = table.next_positions(jnp.array([2, 1]), 3)
    np.testing.assert_array_equal(np.asarray(pos), [[5, 6, -1], [2, -1, -1]])
    np.testing.assert_array_equal(np.asarray(table.slots(pos)), [[5, 6, 0], [10, 0, 0]])
    # a position on an unassigned page (0) lands in the padding page too
    assert int(table.slots(jnp.array([[9], [4]]))[0, 0]) < 4


# ------------------------------------------------------ moves: fork and spec


# dense layer 0 (dense MLP), sparse layers 1-3 (MoE): 1 and 3 K-only, 2 with index V
CONFIG = tiny_config("dsss", disable_index_value=(True, True, False, True))
PAGE = 8


@pytest.mark.slow  # ~19 s: decodes two continuations of a forked prefix
def test_prefix_fork_by_move_gives_identical_continuations():
    model = MiniMaxM3(CONFIG, seed=1)
    layout = CONFIG.layout(num_slots=32 * PAGE, page_size=PAGE)
    step = make_step(model)
    alloc = PageAllocator.for_layout(layout)
    prompt = list(range(3, 22))  # 19 tokens: 3 pages (last one partial)
    a_pages = alloc.alloc_pages(6)
    session = DecodeSession(step, jsk.SparseKVCache.zeros(layout), jnp.asarray(a_pages[None]))
    tokens_a, logits_a = session.generate([prompt], steps=6)
    # fork: copy the prompt's rows into fresh pages, then decode the copy the same way
    b_pages = alloc.alloc_pages(6)
    src = (a_pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[: len(prompt)]
    tgt = (b_pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[: len(prompt)]
    cache = session.cache.move_kv_cache(jnp.asarray(tgt), jnp.asarray(src))
    for pool in jsk.cache.POOL_NAMES:
        for buf in getattr(cache, pool):
            np.testing.assert_array_equal(np.asarray(buf)[tgt], np.asarray(buf)[src])
    ids, pos = pad_prompts([prompt])
    # write the prompt's last token again through the fork to get its logits, then continue
    fork = DecodeSession(step, cache, jnp.asarray(b_pages[None]))
    logits, fork.cache = step(jnp.asarray(ids[:, -1:]), jnp.asarray(pos[:, -1:]), fork.cache, fork.page_table)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), logits_a[0], rtol=1e-5, atol=1e-5)
    token = tokens_a[:, :1]
    for i in range(6):
        logits, fork.cache = step(jnp.asarray(token), jnp.asarray([[len(prompt) + i]]), fork.cache, fork.page_table)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), logits_a[i + 1], rtol=1e-5, atol=1e-5)
        token = tokens_a[:, i + 1 : i + 2]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16], ids=["fp8", "bf16"])
def test_speculative_accept_moves_rows_in_every_pool(dtype):
    layout = small_layout(dtype=dtype, index_dtype=jnp.bfloat16)
    cache = jsk.SparseKVCache.zeros(layout)
    draft = jnp.arange(16, 21, dtype=jnp.int32)  # 5 draft tokens in scratch slots
    rng = np.random.default_rng(3)
    for layer in layout.layer_ids:
        k = jnp.asarray(rng.normal(size=(5, 2, 8)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(5, 2, 6)), jnp.float32)
        ik = jnp.asarray(rng.normal(size=(5, 1, 4)), jnp.float32)
        if layer in layout.k_only_layer_ids:
            cache = cache.set_fused_kv_index_buffer(layer, draft, k, v, ik)
        elif layer in layout.sparse_layer_ids:
            cache = cache.set_fused_kv_index_buffer(layer, draft, k, v, ik, ik * 2)
        else:
            cache = cache.set_kv_buffer(layer, draft, k, v)
    accepted = jnp.array([16, 18, 19], jnp.int32)  # verifier accepts drafts 0, 2, 3
    final = jnp.array([8, 9, 10], jnp.int32)  # where the sequence's next tokens live
    iv_draft_2 = np.asarray(cache.get_index_kv_buffer(6)[1][18])
    snapshot = jax.tree.map(np.asarray, cache)  # the cache is donated below
    moved = jax.jit(lambda c, t, s: c.move_kv_cache(t, s), donate_argnums=0)(cache, final, accepted)
    for pool in jsk.cache.POOL_NAMES:
        for before, after in zip(getattr(snapshot, pool), getattr(moved, pool), strict=True):
            np.testing.assert_array_equal(np.asarray(after)[[8, 9, 10]], before[[16, 18, 19]])
            np.testing.assert_array_equal(np.asarray(after)[16:21], before[16:21])  # drafts stay
    np.testing.assert_array_equal(bits(moved.get_index_kv_buffer(6)[1][9]), bits(iv_draft_2))


# ------------------------------------------------------------------ offload


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_offload_round_trip_to_host_and_another_cache(dtype):
    layout = small_layout(dtype=dtype, index_dtype=dtype)
    rng = np.random.default_rng(5)
    cache = jsk.SparseKVCache.zeros(layout)
    cache = jax.tree.map(  # random bits in every buffer, NaNs included
        lambda b: jnp.asarray(rng.integers(0, np.iinfo(b.dtype).max, size=b.shape, dtype=np.uint64).astype(b.dtype)),
        cache,
    )
    slots = jnp.array([9, 17, 30, 39], jnp.int32)
    block = jax.jit(lambda c, s: c.gather_slots(s))(cache, slots)
    host = jax.device_get(block)  # NumPy leaves: host memory
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    # prefill-to-decode hand-off: a different cache (more slots), other slots
    other = jsk.SparseKVCache.zeros(small_layout(dtype=dtype, index_dtype=dtype, num_slots=64))
    target = jnp.array([50, 51, 8, 70], jnp.int32)
    other = jax.jit(lambda c, b, s: c.scatter_slots(b, s), donate_argnums=0)(other, jax.device_put(host), target)
    for pool in jsk.cache.POOL_NAMES:
        for src, dst in zip(getattr(cache, pool), getattr(other, pool), strict=True):
            np.testing.assert_array_equal(np.asarray(dst)[np.asarray(target)], np.asarray(src)[np.asarray(slots)])
    np.testing.assert_array_equal(bits(block.values("k", 0)), bits(cache.get_key_buffer(0)[slots]))


def test_page_granular_offload_and_mismatch_errors():
    layout = small_layout(dtype=jnp.bfloat16)
    cache = jsk.SparseKVCache.zeros(layout).set_kv_buffer(
        2, jnp.arange(16, 24), jnp.ones((8, 2, 8)), jnp.ones((8, 2, 6))
    )
    block = cache.gather_pages(jnp.array([2]))
    assert block.num_tokens == 8
    restored = jsk.SparseKVCache.zeros(layout).scatter_pages(block, jnp.array([4]))
    np.testing.assert_array_equal(bits(restored.get_key_buffer(2)[32:40]), bits(cache.get_key_buffer(2)[16:24]))
    with pytest.raises(
        ValueError,
        match=r"block layout does not match the cache: dtype: block dtype\(bfloat16\), cache dtype\('float32'\)",
    ):
        jsk.SparseKVCache.zeros(small_layout()).scatter_slots(block, jnp.arange(8))
    with pytest.raises(ValueError, match="block holds 8 tokens but 4 slots were given"):
        cache.scatter_slots(block, jnp.arange(4))
    with pytest.raises(TypeError, match="block must be a KVBlock"):
        cache.scatter_slots(cache, jnp.arange(4))


# ------------------------------------------------------------------- stages


def test_split_stages():
    layout = small_layout()
    a, b = layout.split_stages(2)
    assert (a.start_layer, a.end_layer, b.start_layer, b.end_layer) == (0, 5, 5, 9)
    assert a.local_layer_ids == (0, 1, 2, 3, 4) and b.local_layer_ids == (5, 6, 7, 8)
    x, y, z = layout.split_stages([(0, 3), (3, 6), (6, 9)])
    assert y.local_k_only_layer_ids == (3, 4, 5) and z.local_index_kv_layer_ids == (6, 7, 8)
    with pytest.raises(LayoutError, match="must tile"):
        layout.split_stages([(0, 3), (4, 9)])
    with pytest.raises(LayoutError, match="cannot split 9 local layers into 10 stages"):
        layout.split_stages(10)


@pytest.mark.slow  # 10-15 s: the pipeline-stage model compiled beside the one-stage one
def test_two_stage_pipeline_equals_one_stage():
    config = tiny_config("ddssss", disable_index_value=(True, True, True, False, True, False))  # K-only 2, 4
    full_layout = config.layout(num_slots=16 * PAGE, page_size=PAGE)
    stages = full_layout.split_stages(2)
    full = MiniMaxM3(config, seed=2)
    parts = [MiniMaxM3(config, seed=2, layer_ids=s.local_layer_ids) for s in stages]
    assert [len(p.layers) for p in parts] == [3, 3]
    ids, pos = pad_prompts([list(range(1, 20)), list(range(40, 52))])
    table = jnp.asarray(np.arange(1, 9).reshape(2, 4), jnp.int32)
    want, _ = full(jnp.asarray(ids), jnp.asarray(pos), jsk.SparseKVCache.zeros(full_layout), table)

    precision = KVPrecision()
    caches = [jsk.SparseKVCache.zeros(s) for s in stages]
    x = parts[0].embed(jnp.asarray(ids))
    for i, part in enumerate(parts):
        x, caches[i], _ = part.forward_layers(x, jnp.asarray(pos), caches[i], table, precision)
    got = parts[-1].head(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert len(caches[0].k) == 3 and len(caches[1].k) == 3
    with pytest.raises(
        NotLocalLayerError, match=r"layer_id=0 \(attention layer\) is not local to this pipeline stage \[3, 6\)"
    ):
        parts[0].forward_layers(parts[0].embed(jnp.asarray(ids)), jnp.asarray(pos), caches[1], table, precision)


# ------------------------------------------------------ device decode loop


@pytest.mark.slow
def test_device_loop_with_on_device_pages_equals_host_loop():
    config = CONFIG
    model = MiniMaxM3(config, seed=4)
    layout = config.layout(num_slots=24 * PAGE, page_size=PAGE)
    prompts = [list(range(5, 18)), list(range(30, 37)), list(range(60, 68))]  # 13, 7, 8 tokens
    steps = 12
    # host-driven reference, with its own (interleaved) pages
    host = DecodeSession(
        make_step(model), jsk.SparseKVCache.zeros(layout), jnp.asarray(np.arange(1, 19).reshape(6, 3).T)
    )
    host_tokens, host_logits = host.generate(prompts, steps)

    # device loop: prefill with pages reserved on device, then all steps in one jitted call
    batch, max_pages = len(prompts), 6
    table, free = PageTable.empty(batch, max_pages, PAGE), FreePages.full(layout.num_pages)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    table, free, ok = reserve_pages(table, free, lengths, max_new_pages=2)
    assert bool(ok)
    ids, pos = pad_prompts(prompts)
    logits, cache = make_step(model)(jnp.asarray(ids), jnp.asarray(pos), jsk.SparseKVCache.zeros(layout), table.pages)
    table = table.advance(lengths)
    first = jnp.argmax(logits[jnp.arange(batch), lengths - 1], axis=-1)
    np.testing.assert_array_equal(np.asarray(first), host_tokens[:, 0])
    loop = make_device_loop(model, steps)
    tokens, step_logits, cache, table, free, ok = loop(first, cache, table, free)
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(tokens), host_tokens[:, 1:])
    for i in range(steps):
        np.testing.assert_allclose(np.asarray(step_logits[i]), host_logits[i + 1], rtol=1e-5, atol=1e-5)
    pages = np.asarray(table.pages)
    used = pages[pages != 0]
    assert len(set(used.tolist())) == len(used)  # no page shared
    np.testing.assert_array_equal(np.asarray(table.lengths), np.asarray(lengths) + steps)


@pytest.mark.slow  # ~10 s: compiles the device loop for one more case
def test_device_loop_reports_running_out_of_pages():
    model = MiniMaxM3(CONFIG, seed=4)
    layout = CONFIG.layout(num_slots=4 * PAGE, page_size=PAGE)
    table, free = PageTable.empty(1, 4, PAGE), FreePages.full(layout.num_pages, exclude=[2, 3, 4])
    table, free, ok = reserve_pages(table, free, jnp.array([7]), 1)
    assert bool(ok)
    table = table.advance(jnp.array([7]))
    _, _, _, table, free, ok = make_device_loop(model, 3)(jnp.array([1]), jsk.SparseKVCache.zeros(layout), table, free)
    assert not bool(ok)


# -------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32], ids=["fp8", "bf16", "f32"])
def test_checkpoint_round_trip(tmp_path, dtype):
    layout = small_layout(dtype=dtype, index_dtype=jnp.bfloat16, start_layer=2, end_layer=8)
    rng = np.random.default_rng(7)
    cache = jax.tree.map(
        lambda b: jnp.asarray(rng.integers(0, 255, size=b.shape).astype(b.dtype)), jsk.SparseKVCache.zeros(layout)
    )
    save_cache(tmp_path / "ckpt", cache)
    restored = restore_cache(tmp_path / "ckpt", layout)
    assert restored.layout == layout
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restore_cache(tmp_path / "ckpt").layout == layout  # layout read back from the checkpoint
    with pytest.raises(FileExistsError):
        save_cache(tmp_path / "ckpt", cache)
    save_cache(tmp_path / "ckpt", cache, overwrite=True)


def test_checkpoint_refuses_another_layout(tmp_path):
    save_cache(tmp_path / "ckpt", jsk.SparseKVCache.zeros(small_layout()))
    with pytest.raises(
        LayoutError, match=r"checkpoint layout differs.*k_only_layer_ids: saved \(3, 4, 5\), expected \(3, 4\)"
    ):
        restore_cache(tmp_path / "ckpt", small_layout(k_only_layer_ids=(3, 4)))
    with pytest.raises(FileNotFoundError, match="not a jax_sparse_kv checkpoint"):
        restore_cache(tmp_path)
