"""The measurements of BENCHMARKS.md, one function per section.

Each returns a JSON-able dict. Sizes come from a `Sizes` preset (full or quick);
everything else is fixed so that runs compare.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_kv as jsk
from benchmarks.timing import time_interleaved
from jax_sparse_kv import ops
from jax_sparse_kv.ops import _reference as previous
from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG


@dataclasses.dataclass(frozen=True)
class Sizes:
    capacities: tuple[int, ...]  # log2 of slots
    repeats: int
    model_slots: int
    model_tokens: int
    contexts: tuple[int, ...]
    e2e_batch: int
    e2e_prompt: int
    e2e_steps: int
    compile_steps: int
    decode_batches: tuple[int, ...] = (1, 8)
    decode_long: int | None = 131072  # one more context, batch 1 only
    decode_rounds: int = 25
    m3_context: int = 32768


FULL = Sizes((12, 13, 14, 15, 16, 17, 18), 30, 8192, 64, (4096, 16384, 65536), 8, 64, 32, 100)
QUICK = Sizes((10, 12), 3, 512, 8, (1024, 2048), 2, 16, 4, 5, (1, 2), None, 2, 1024)

HEADS, DIM = 4, 128  # MiniMax-M3-like main K/V
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn}


def m3_layout(num_slots: int, dtype, index_dtype=None) -> jsk.SparseKVLayout:
    return jsk.SparseKVLayout.from_hf_config(
        MINIMAX_M3_LIKE_CONFIG, num_slots=num_slots, page_size=128, dtype=dtype, index_dtype=index_dtype
    )


# ------------------------------------------------------------ 1. capacity


def capacity_scaling(sizes: Sizes) -> dict:
    """64-token K+V write into one layer vs capacity, ours vs a plain `.at[].set`."""
    n = 64
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(n, HEADS, DIM)), jnp.float32)
    out: dict = {"tokens": n, "heads": HEADS, "dim": DIM, "input_dtype": "float32", "rows": {}}

    def ours_step(cache, loc, k):
        return cache.set_kv_buffer(0, loc, k, k)

    def plain_step(bufs, loc, k):
        kb, vb = bufs
        return kb.at[loc].set(k.astype(kb.dtype)), vb.at[loc].set(k.astype(vb.dtype))

    ours = jax.jit(ours_step, donate_argnums=0)
    plain = jax.jit(plain_step, donate_argnums=0)
    for name, dtype in DTYPES.items():
        contenders = {}
        for log2 in sizes.capacities:
            slots = 2**log2
            layout = jsk.SparseKVLayout(
                (0,), (), num_slots=slots, page_size=128, head_num=HEADS, head_dim=DIM, dtype=dtype
            )
            loc = jnp.asarray(rng.choice(slots, n, replace=False) + 128, jnp.int32)
            bufs = (jnp.zeros(layout.pool_shapes()["k"], dtype), jnp.zeros(layout.pool_shapes()["v"], dtype))
            contenders[("ours", log2)] = (ours, jsk.SparseKVCache.zeros(layout), (loc, k))
            contenders[("plain", log2)] = (plain, bufs, (loc, k))
        stats = time_interleaved(contenders, rounds=sizes.repeats)
        del contenders
        rows = [{"log2_slots": p, "ours": stats["ours", p], "plain": stats["plain", p]} for p in sizes.capacities]
        first, last = rows[0], rows[-1]
        out["rows"][name] = {
            "points": rows,
            "ours_ratio": last["ours"]["median"] / first["ours"]["median"],
            "plain_ratio": last["plain"]["median"] / first["plain"]["median"],
        }
    return out


# ------------------------------------------------------- 2. model-sized step


def _write_all_layers(cache, loc, k, v, ik, scale):
    """k, v: one ``[n, heads, dim]`` array per layer; ik: one ``[n, 1, dim]`` per sparse layer.

    Per-layer arrays, as a model produces them (a stacked array would add a slice copy per layer).
    """
    layout = cache.layout
    for i, layer in enumerate(layout.local_layer_ids):
        if layer in layout.sparse_layer_ids:
            j = layout.sparse_layer_ids.index(layer)
            idx_v = None if layer in layout.k_only_layer_ids else ik[j]
            cache = cache.set_fused_kv_index_buffer(layer, loc, k[i], v[i], ik[j], idx_v, scale, scale)
        else:
            cache = cache.set_kv_buffer(layer, loc, k[i], v[i], scale, scale)
    return cache


def _torch_step(torch, k_bufs, v_bufs, i_bufs, loc, k, v, ik, fp8: bool, scale: float, sparse_index):
    """What SGLang's pool does per layer when no fused kernel applies (eager PyTorch)."""
    for layer in range(len(k_bufs)):
        if fp8:
            k_bufs[layer][loc] = k[layer].div(scale).to(torch.float8_e4m3fn).view(torch.uint8)
            v_bufs[layer][loc] = v[layer].div(scale).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            k_bufs[layer].index_put_((loc,), k[layer])
            v_bufs[layer].index_put_((loc,), v[layer])
        j = sparse_index.get(layer)
        if j is not None:
            if fp8:
                i_bufs[j][loc] = ik[j].div(scale).to(torch.float8_e4m3fn).view(torch.uint8)
            else:
                i_bufs[j].index_put_((loc,), ik[j])


def model_step(sizes: Sizes) -> dict:
    """All 60 layers of a MiniMax-M3-like cache written in one donated jitted call.

    Every contender (ours bf16/fp8, the NumPy limit and context rows, the
    PyTorch peer) is timed in the same rounds, interleaved, so ratios are fair.
    """
    n, slots = sizes.model_tokens, sizes.model_slots
    rng = np.random.default_rng(1)
    loc_np = (rng.choice(slots, n, replace=False) + 128).astype(np.int32)  # decode tokens of n sequences
    loc = jnp.asarray(loc_np)
    out: dict = {"tokens": n, "slots": slots, "variants": {}}
    step = jax.jit(_write_all_layers, donate_argnums=0)
    contenders: dict = {}
    for name, dtype, scale in (("bf16", jnp.bfloat16, 1.0), ("fp8_e4m3", jnp.float8_e4m3fn, 0.5)):
        layout = m3_layout(slots, dtype)
        num_layers, num_sparse = len(layout.layer_ids), len(layout.sparse_layer_ids)
        k = tuple(jnp.asarray(rng.normal(size=(n, HEADS, DIM)), jnp.bfloat16) for _ in range(num_layers))
        v = tuple(jnp.asarray(rng.normal(size=(n, HEADS, DIM)), jnp.bfloat16) for _ in range(num_layers))
        ik = tuple(jnp.asarray(rng.normal(size=(n, 1, DIM)), jnp.bfloat16) for _ in range(num_sparse))
        cache = jsk.SparseKVCache.zeros(layout)
        args = (loc, k, v, ik, jnp.float32(scale))
        stats = step.lower(cache, *args).compile().memory_analysis()
        contenders[name] = (step, cache, args)
        out["variants"][name] = {
            "bytes_written": n * sum(layout.bytes_per_token().values()),
            "temp_bytes": stats.temp_size_in_bytes,
            "alias_bytes": stats.alias_size_in_bytes,
            "cache_bytes": sum(layout.pool_bytes().values()),
        }
    written = out["variants"]["bf16"]["bytes_written"]
    # the same step writing a single token: the fixed cost of 177 per-layer writes
    one_cache = jsk.SparseKVCache.zeros(m3_layout(slots, jnp.bfloat16))
    k1 = tuple(x[:1] for x in contenders["bf16"][2][1])
    ik1 = tuple(x[:1] for x in contenders["bf16"][2][3])
    contenders["bf16_one_token"] = (step, one_cache, (loc[:1], k1, k1, ik1, jnp.float32(1.0)))

    # the limit: a NumPy copy of the same number of bytes
    src = np.random.default_rng(2).integers(0, 255, written, dtype=np.uint8)
    dst = np.empty_like(src)
    contenders["numpy_copy"] = (lambda state: np.copyto(dst, src), None, ())
    # context: the same rows into the same per-layer buffers with NumPy fancy indexing ...
    layout = m3_layout(slots, jnp.bfloat16)
    shapes = [layout.pool_shapes()["k"]] * (2 * len(layout.layer_ids)) + [layout.pool_shapes()["index_k"]] * len(
        layout.sparse_layer_ids
    )
    bufs = [np.zeros(shape, np.uint16) for shape in shapes]
    rows = [np.random.default_rng(6).integers(0, 2**16, (n,) + shape[1:], dtype=np.uint16) for shape in shapes]

    def numpy_scattered(state):
        for b, r in zip(bufs, rows, strict=True):
            b[loc_np] = r

    # ... and into one contiguous destination: what scattering costs by itself
    dense = [np.zeros_like(r) for r in rows]

    def numpy_contiguous(state):
        for d, r in zip(dense, rows, strict=True):
            d[...] = r

    contenders["numpy_scattered"] = (numpy_scattered, None, ())
    contenders["numpy_contiguous_rows"] = (numpy_contiguous, None, ())
    torch_info = _torch_peer(sizes, loc_np, contenders)

    stats = time_interleaved(contenders, rounds=sizes.repeats)
    contenders.clear()
    for name in ("bf16", "fp8_e4m3"):
        variant = out["variants"][name]
        variant["time"] = stats[name]
        variant["gbps"] = variant["bytes_written"] / stats[name]["median"] / 1e9
    for name in ("numpy_copy", "numpy_scattered", "numpy_contiguous_rows"):
        out[name] = {"time": stats[name], "bytes": written, "gbps": written / stats[name]["median"] / 1e9}
    for variant in out["variants"].values():
        variant["fraction_of_copy"] = variant["gbps"] / out["numpy_copy"]["gbps"]
    out["fp8_over_bf16"] = stats["fp8_e4m3"]["median"] / stats["bf16"]["median"]
    out["bf16_one_token"] = {"time": stats["bf16_one_token"]}
    out["torch"] = torch_info
    if torch_info.get("available"):
        for name in ("bf16", "fp8_e4m3"):
            torch_info[name] = {"time": stats["torch_" + name]}
            torch_info[name]["ours_speedup"] = stats["torch_" + name]["median"] / stats[name]["median"]
    return out


def _torch_peer(sizes: Sizes, loc_np: np.ndarray, contenders: dict) -> dict:
    """Adds the PyTorch eager contenders (SGLang's per-layer fallback writes) if torch is installed."""
    try:
        import torch
    except ImportError:
        return {"available": False, "why": "torch not installed (see BUILD.md, Benchmarks)"}
    n, rows = sizes.model_tokens, sizes.model_slots + 128
    layout = m3_layout(sizes.model_slots, jnp.bfloat16)
    num_layers, num_sparse = len(layout.layer_ids), len(layout.sparse_layer_ids)
    sparse_index = {layer: j for j, layer in enumerate(layout.sparse_layer_ids)}
    g = torch.Generator().manual_seed(3)
    k = torch.randn(num_layers, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(num_layers, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    ik = torch.randn(num_sparse, n, 1, DIM, generator=g).to(torch.bfloat16)
    loc = torch.from_numpy(loc_np.astype(np.int64))
    for name, fp8 in (("bf16", False), ("fp8_e4m3", True)):
        dtype = torch.uint8 if fp8 else torch.bfloat16
        k_bufs = [torch.zeros(rows, HEADS, DIM, dtype=dtype) for _ in range(num_layers)]
        v_bufs = [torch.zeros(rows, HEADS, DIM, dtype=dtype) for _ in range(num_layers)]
        i_bufs = [torch.zeros(rows, 1, DIM, dtype=dtype) for _ in range(num_sparse)]
        call = functools.partial(_torch_step, torch, k_bufs, v_bufs, i_bufs, loc, k, v, ik, fp8, 0.5, sparse_index)
        contenders["torch_" + name] = (lambda state, call=call: call(), None, ())
    return {"available": True, "version": torch.__version__, "threads": torch.get_num_threads()}


# ------------------------------------------------------------- 3. compile


def compilation(sizes: Sizes) -> dict:
    from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, demo_config, make_step
    from jax_sparse_kv.paging import interleaved_page_table

    n = sizes.model_tokens
    layout = m3_layout(sizes.model_slots, jnp.bfloat16)
    num_layers, num_sparse = len(layout.layer_ids), len(layout.sparse_layer_ids)
    args = (
        jsk.SparseKVCache.abstract(layout),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        (jax.ShapeDtypeStruct((n, HEADS, DIM), jnp.bfloat16),) * num_layers,
        (jax.ShapeDtypeStruct((n, HEADS, DIM), jnp.bfloat16),) * num_layers,
        (jax.ShapeDtypeStruct((n, 1, DIM), jnp.bfloat16),) * num_sparse,
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    fresh = functools.partial(_write_all_layers)  # a new callable: no cached executable to reuse
    t0 = time.perf_counter()
    jax.jit(fresh, donate_argnums=0).lower(*args).compile()
    write_compile = time.perf_counter() - t0

    config = demo_config()
    model = MiniMaxM3(config, seed=0)
    batch, prompt, steps = 4, 32, sizes.compile_steps
    pages = -(-(prompt + steps) // 16)
    model_layout = config.layout(num_slots=batch * pages * 16, page_size=16, dtype=jnp.bfloat16)
    step = make_step(model)
    table = jnp.asarray(interleaved_page_table(batch, pages))
    t0 = time.perf_counter()
    step.fn.lower(
        step.params,
        jnp.zeros((batch, 1), jnp.int32),
        jnp.zeros((batch, 1), jnp.int32),
        jsk.SparseKVCache.abstract(model_layout),
        table,
    ).compile()
    decode_compile = time.perf_counter() - t0
    session = DecodeSession(step, jsk.SparseKVCache.zeros(model_layout), table)
    prompts = [list(range(1, prompt + 1))] * batch
    session.generate(prompts, steps)
    return {
        "write_step_compile_s": write_compile,
        "write_step_layers": num_layers,
        "decode_step_compile_s": decode_compile,
        "decode_steps": steps,
        "compilations": step.compilations(),
        "shapes": 2,
    }


# ------------------------------------------- 4. decode attention vs the memory limit

PAGE = BLOCK = 128
TOPK = 16
Q_HEADS, INDEX_HEADS = 16, 4
M3_Q_HEADS = 64


def _bf16_storage(rng: np.random.Generator, shape: tuple[int, ...]) -> jax.Array:
    """Random finite bf16 values (|x| in [2^-7, 2)) as the uint16 storage the cache holds."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return jnp.asarray((bits & 0x83FF) | 0x3C00)


def _shuffled_tables(rng: np.random.Generator, batch: int, context: int, num_pages: int, width: int) -> jax.Array:
    """``[batch, width // PAGE]``: each sequence's ``context // PAGE`` pages at random distinct ids, then 0s."""
    need = context // PAGE
    ids = rng.permutation(num_pages)[: batch * need].reshape(batch, need) + 1
    return jnp.asarray(np.pad(ids, ((0, 0), (0, width // PAGE - need))), jnp.int32)


def _attention_fns(impl):
    """Jitted one-layer decode attention, dense and sparse (indexer + top-16 blocks), over uint16 bf16 pools."""

    def src(buf, table):
        return ops.PagedKV(buf, table, PAGE, dtype=jnp.bfloat16)

    def dense(k, v, q, pos, table):
        return impl.dense_attention(q, src(k, table), src(v, table), pos)

    def sparse(k, v, ik, q, iq, pos, table):
        scores = impl.block_scores(iq, src(ik, table), pos, BLOCK)
        sel = ops.select_blocks(scores, pos, BLOCK, TOPK, init_blocks=0, local_blocks=1)  # one per index head
        return impl.block_sparse_attention(q, src(k, table), src(v, table), pos, sel, BLOCK)

    return jax.jit(dense), jax.jit(sparse)


def _pure(fn):
    """A stateless call as a `time_interleaved` contender."""

    def call(state, *args):
        jax.block_until_ready(fn(*args))
        return state

    return call


def _copy_contender(nbytes: int, buffers: dict) -> tuple:
    """A NumPy copy of `nbytes` (the limit), sharing one source/destination pair per run."""
    if buffers.get("n", 0) < nbytes:
        buffers.clear()
        buffers.update(n=nbytes, src=np.random.default_rng(7).integers(0, 255, nbytes, dtype=np.uint8))
        buffers["dst"] = np.empty_like(buffers["src"])
    src, dst = buffers["src"][:nbytes], buffers["dst"][:nbytes]
    return (lambda state: np.copyto(dst, src), None, ())


def decode_vs_memory(sizes: Sizes) -> dict:
    """One layer's decode attention, dense and sparse, vs a NumPy copy of the bytes the step must read.

    Per (batch, context) every contender runs in the same rounds, interleaved:
    the chunked ops, the previous implementation (`jax_sparse_kv.ops._reference`),
    NumPy copies of the must-read bytes, and at the shortest context the same
    sequences in a page table as wide as the longest context.
    """
    rng = np.random.default_rng(8)
    contexts = list(sizes.contexts)
    wide = max(contexts)
    new_dense, new_sparse = _attention_fns(ops)
    old_dense, old_sparse = _attention_fns(previous)
    out: dict = {
        "page_size": PAGE,
        "block_size": BLOCK,
        "topk": TOPK,
        "q_heads": Q_HEADS,
        "kv_heads": HEADS,
        "head_dim": DIM,
        "index_heads": INDEX_HEADS,
        "index_dim": DIM,
        "wide": wide,
        "rounds": sizes.decode_rounds,
        "rows": [],
    }
    copies: dict = {}
    for batch in sizes.decode_batches:
        ctxs = contexts + ([sizes.decode_long] if batch == 1 and sizes.decode_long else [])
        num_pages = batch * max(ctxs) // PAGE
        rows = (num_pages + 1) * PAGE
        k, v = _bf16_storage(rng, (rows, HEADS, DIM)), _bf16_storage(rng, (rows, HEADS, DIM))
        ik = _bf16_storage(rng, (rows, 1, DIM))
        q = jnp.asarray(rng.normal(size=(batch, 1, Q_HEADS, DIM)), jnp.float32)
        iq = jnp.asarray(rng.normal(size=(batch, 1, INDEX_HEADS, DIM)), jnp.float32)
        for context in ctxs:
            table = _shuffled_tables(rng, batch, context, num_pages, context)
            pos = jnp.full((batch, 1), context - 1, jnp.int32)
            dense_bytes = batch * context * HEADS * DIM * 2 * 2
            blocks = min(TOPK, context // BLOCK)  # fewer candidates than top-k: all of them
            sparse_bytes = batch * (context * DIM * 2 + INDEX_HEADS * blocks * BLOCK * DIM * 2 * 2)
            c = {
                "dense": (_pure(new_dense), None, (k, v, q, pos, table)),
                "sparse": (_pure(new_sparse), None, (k, v, ik, q, iq, pos, table)),
                "dense_prev": (_pure(old_dense), None, (k, v, q, pos, table)),
                "sparse_prev": (_pure(old_sparse), None, (k, v, ik, q, iq, pos, table)),
                "copy_dense": _copy_contender(dense_bytes, copies),
                "copy_sparse": _copy_contender(sparse_bytes, copies),
            }
            if context == min(contexts) and wide > context:  # the same sequences in a table as wide as the longest
                wide_table = jnp.pad(table, ((0, 0), (0, (wide - context) // PAGE)))
                c["dense_wide"] = (_pure(new_dense), None, (k, v, q, pos, wide_table))
                c["sparse_wide"] = (_pure(new_sparse), None, (k, v, ik, q, iq, pos, wide_table))
                if batch == 1:
                    c["dense_prev_wide"] = (_pure(old_dense), None, (k, v, q, pos, wide_table))
            stats = time_interleaved(c, rounds=sizes.decode_rounds)
            t = {name: st["median"] for name, st in stats.items()}
            row = {
                "batch": batch,
                "context": context,
                "dense_bytes": dense_bytes,
                "sparse_bytes": sparse_bytes,
                "times": stats,
                "fraction": {
                    "dense": t["copy_dense"] / t["dense"],
                    "sparse": t["copy_sparse"] / t["sparse"],
                    "dense_prev": t["copy_dense"] / t["dense_prev"],
                    "sparse_prev": t["copy_sparse"] / t["sparse_prev"],
                },
                "speedup": {"dense": t["dense_prev"] / t["dense"], "sparse": t["sparse_prev"] / t["sparse"]},
                "sparse_vs_dense": t["dense"] / t["sparse"],
                "sparse_vs_dense_prev": t["dense_prev"] / t["sparse_prev"],
            }
            if "dense_wide" in t:
                row["wide_over_narrow"] = {
                    "dense": t["dense_wide"] / t["dense"],
                    "sparse": t["sparse_wide"] / t["sparse"],
                }
                if "dense_prev_wide" in t:
                    row["wide_over_narrow"]["dense_prev"] = t["dense_prev_wide"] / t["dense_prev"]
            out["rows"].append(row)
            del c
        del k, v, ik
    copies.clear()
    out["m3"] = m3_decode_step(sizes)
    return out


def m3_model_config():
    """One sparse MiniMax-M3 layer at the real attention shapes, everything else tiny (attention dominates)."""
    from jax_sparse_kv.nn import tiny_config

    return tiny_config(
        "s",
        "d",
        vocab_size=256,
        hidden_size=64,
        dense_intermediate_size=64,
        num_attention_heads=M3_Q_HEADS,
        num_key_value_heads=HEADS,
        head_dim=DIM,
        rotary_dim=DIM // 2,
        index_n_heads=INDEX_HEADS,
        index_head_dim=DIM,
        index_block_size=BLOCK,
        index_topk_blocks=TOPK,
        index_local_blocks=1,
    )


def _compute_floor(batch: int, context: int, q_heads: int, sel_heads: int, selected_tokens: int):
    """The step's unavoidable arithmetic alone, on f32 operands that stay in cache.

    Per sequence: index scores of ``sel_heads`` query rows against every
    token's index K, and attention of ``q_heads`` query heads over
    ``selected_tokens`` per selection head (scores, softmax, weighted sum), as
    the same f32 dots the step does, 2048 tokens at a time against one
    chunk that is reused (1 MiB, cache resident): no gather, no conversion, no
    memory traffic. Its time is what this CPU's arithmetic needs for the step.
    """
    chunk = 2048
    rng = np.random.default_rng(10)
    group = q_heads // sel_heads
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    iq, q = f32(rng.normal(size=(sel_heads, DIM))), f32(rng.normal(size=(group, DIM)))
    # a few rows more than a chunk: each step slices at its own offset, so no step is loop-invariant
    k, v = f32(rng.normal(size=(chunk + 7, DIM))), f32(rng.normal(size=(chunk + 7, DIM)))
    index_steps = batch * -(-context // chunk)
    attention_steps = batch * sel_heads * -(-selected_tokens // chunk)

    @jax.jit
    def floor(iq, q, k, v):
        def score(i, acc):
            kc = jax.lax.dynamic_slice_in_dim(k, i % 8, chunk)
            return acc + (kc @ iq.T).max(axis=0)

        def attend(i, acc):
            kc, vc = jax.lax.dynamic_slice_in_dim(k, i % 8, chunk), jax.lax.dynamic_slice_in_dim(v, i % 8, chunk)
            p = jax.nn.softmax(q @ kc.T, axis=-1)
            return acc + p @ vc

        return (
            jax.lax.fori_loop(0, index_steps, score, jnp.zeros(sel_heads, jnp.float32)),
            jax.lax.fori_loop(0, attention_steps, attend, jnp.zeros((group, DIM), jnp.float32)),
        )

    flops = 2 * chunk * DIM * (index_steps * sel_heads + 2 * attention_steps * group)
    return _pure(floor), (iq, q, k, v), flops


def m3_decode_step(sizes: Sizes) -> dict:
    """A MiniMax-M3-shaped sparse attention decode step, three ways, against the copy and the compute floor.

    - ``step``: built from the cache and the ops: writes this step's K, V and
      index K into a one-layer bf16 cache (donated), scores index K, selects
      top-16 blocks per index head, attends over them (attention only).
    - ``model``: the same through the `MiniMaxM3` module (one sparse layer at
      the real attention shapes, hidden size 64, bf16 weights): projections,
      norms, RoPE, the indexer, the decode-attention dispatch, an MLP and the
      LM head, one jitted call with the cache donated.
    - ``floor``: the step's unavoidable arithmetic on f32 operands already in
      cache (`_compute_floor`): with 64 query heads the step does ~8 flops per
      byte it must read, about what this 2-core AVX2 CPU does per byte a copy
      moves, so the step is bound by arithmetic as much as by memory.
    """
    from flax import nnx

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn import make_step as make_model_step

    context = sizes.m3_context
    rng = np.random.default_rng(9)
    out: dict = {
        "context": context,
        "q_heads": M3_Q_HEADS,
        "kv_heads": HEADS,
        "head_dim": DIM,
        "index_heads": INDEX_HEADS,
        "index_dim": DIM,
        "block_size": BLOCK,
        "topk": TOPK,
        "rows": [],
    }

    def make_step(impl):
        def step(cache, q, k, v, iq, ik, pos, table):
            loc = ops.token_slots(table, pos, PAGE).reshape(-1)
            cache = cache.set_fused_kv_index_buffer(0, loc, k, v, ik)
            kb, vb = cache.get_kv_buffer(0)
            src = functools.partial(ops.PagedKV, page_table=table, page_size=PAGE)
            scores = impl.block_scores(iq, src(cache.get_index_k_buffer(0)), pos, BLOCK)
            sel = ops.select_blocks(scores, pos, BLOCK, TOPK, init_blocks=0, local_blocks=1)  # [b, 1, 4, 16]
            return impl.block_sparse_attention(q, src(kb), src(vb), pos, sel, BLOCK), cache

        jitted = jax.jit(step, donate_argnums=0)

        def call(cache, *args):
            att, cache = jitted(cache, *args)
            jax.block_until_ready(att)
            return cache

        return call

    config = m3_model_config()
    model = MiniMaxM3(config, seed=0, dtype=jnp.bfloat16)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # read every step
    model_step = make_model_step(model)

    def call_model(cache, tokens, pos, table):
        logits, cache = model_step(tokens, pos, cache, table)
        jax.block_until_ready(logits)
        return cache

    new, old = make_step(ops), make_step(previous)
    copies: dict = {}
    for batch in sizes.decode_batches:
        num_pages = batch * context // PAGE
        layout = config.layout(num_pages * PAGE, PAGE, jnp.bfloat16)
        rows = (num_pages + 1) * PAGE

        def filled(layout=layout, rows=rows):
            empty = jsk.SparseKVCache.zeros(layout)
            return dataclasses.replace(
                empty,
                k=(_bf16_storage(rng, (rows, HEADS, DIM)),),
                v=(_bf16_storage(rng, (rows, HEADS, DIM)),),
                index_k=(_bf16_storage(rng, (rows, 1, DIM)),),
            )

        table = _shuffled_tables(rng, batch, context, num_pages, context)
        pos = jnp.full((batch, 1), context - 1, jnp.int32)  # this step writes the last token of each sequence
        args = (
            jnp.asarray(rng.normal(size=(batch, 1, M3_Q_HEADS, DIM)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, HEADS, DIM)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(batch, HEADS, DIM)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(batch, 1, INDEX_HEADS, DIM)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, 1, DIM)), jnp.bfloat16),
            pos,
            table,
        )
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, 1)), jnp.int32)
        selected = min(TOPK, context // BLOCK) * BLOCK
        must_read = batch * (context * DIM * 2 + INDEX_HEADS * selected * DIM * 2 * 2)
        written = batch * (2 * HEADS * DIM + DIM) * 2
        floor_fn, floor_args, flops = _compute_floor(batch, context, M3_Q_HEADS, INDEX_HEADS, selected)
        c = {
            "step": (new, filled(), args),
            "model": (call_model, filled(), (tokens, pos, table)),
            "step_prev": (old, filled(), args),
            "floor": (floor_fn, None, floor_args),
            "copy": _copy_contender(must_read + written, copies),
            "copy_model": _copy_contender(must_read + written + weight_bytes, copies),
        }
        stats = time_interleaved(c, rounds=sizes.decode_rounds)
        del c
        t = {name: st["median"] for name, st in stats.items()}
        out["rows"].append(
            {
                "batch": batch,
                "must_read_bytes": must_read,
                "written_bytes": written,
                "weight_bytes": weight_bytes,
                "flops": flops,
                "times": stats,
                "fraction": t["copy"] / t["step"],
                "fraction_model": t["copy_model"] / t["model"],
                "fraction_prev": t["copy"] / t["step_prev"],
                "fraction_floor": t["copy"] / t["floor"],
                "gflops_floor": flops / t["floor"] / 1e9,
                "speedup": t["step_prev"] / t["step"],
            }
        )
    return out


# ---------------------------------------------------------- 5. end to end


def end_to_end(sizes: Sizes) -> dict:
    from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, demo_config, make_step
    from jax_sparse_kv.paging import interleaved_page_table

    config = demo_config()
    model = MiniMaxM3(config, seed=0)
    rng = np.random.default_rng(5)
    batch, prompt, steps = sizes.e2e_batch, sizes.e2e_prompt, sizes.e2e_steps
    prompts = [rng.integers(0, config.vocab_size, prompt).tolist() for _ in range(batch)]
    pages = -(-(prompt + steps) // 16)
    out: dict = {"batch": batch, "prompt": prompt, "steps": steps, "variants": {}}
    for name, dtype, scale in (("bf16", jnp.bfloat16, 1.0), ("fp8_e4m3", jnp.float8_e4m3fn, 0.5)):
        layout = config.layout(num_slots=batch * pages * 16, page_size=16, dtype=dtype)
        session = DecodeSession(
            make_step(model, kv_scale=scale),
            jsk.SparseKVCache.zeros(layout),
            jnp.asarray(interleaved_page_table(batch, pages)),
        )
        session.generate(prompts, steps, warmup=True)
        t = session.timings
        out["variants"][name] = {
            "prefill_tokens_per_s": t["prefill_tokens"] / t["prefill_s"],
            "decode_tokens_per_s": t["decode_tokens"] / t["decode_s"] if t["decode_tokens"] else None,
            "decode_ms_per_step": t["decode_s"] / max(steps - 1, 1) * 1e3,
        }
    return out


# --------------------------------------------------------------- 6. memory


def memory(sizes: Sizes) -> dict:
    out = {}
    for name, dtype, index_dtype in (
        ("bf16", jnp.bfloat16, None),
        ("fp8_e4m3", jnp.float8_e4m3fn, None),
        ("fp8_e4m3 + bf16 index", jnp.float8_e4m3fn, jnp.bfloat16),
    ):
        layout = m3_layout(128, dtype, index_dtype)
        out[name] = layout.bytes_per_token()
    return out
