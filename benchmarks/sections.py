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
from benchmarks.timing import time_interleaved, time_pure
from jax_sparse_kv import ops
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


FULL = Sizes((12, 13, 14, 15, 16, 17, 18), 30, 8192, 64, (4096, 16384, 65536), 8, 64, 32, 100)
QUICK = Sizes((10, 12), 3, 512, 8, (1024, 2048), 2, 16, 4, 5)

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
    from jax_sparse_kv.nn import DecodeSession, MiniMaxLikeModel, demo_config, make_step
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
    model = MiniMaxLikeModel(config, seed=0)
    batch, prompt, steps = 4, 32, sizes.compile_steps
    pages = -(-(prompt + steps) // 16)
    model_layout = config.layout(num_slots=batch * pages * 16, page_size=16, dtype=jnp.bfloat16)
    step = make_step(model)
    table = jnp.asarray(interleaved_page_table(batch, pages))
    t0 = time.perf_counter()
    step.fn.lower(
        step.params, jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32),
        jsk.SparseKVCache.abstract(model_layout), table,
    ).compile()  # fmt: skip
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


# ----------------------------------------------------------- 4. attention


def attention(sizes: Sizes) -> dict:
    """One layer's decode attention: dense over all tokens vs indexer + top-16 blocks of 128."""
    block, topk, q_heads, index_heads = 128, 16, 16, 4
    rng = np.random.default_rng(4)
    out: dict = {"block_size": block, "topk": topk, "q_heads": q_heads, "kv_heads": HEADS, "rows": []}

    def dense(cache, q, pos, table):
        k, v = cache.get_kv_buffer(0)
        return ops.dense_attention(q, ops.PagedKV(k, table, block), ops.PagedKV(v, table, block), pos)

    def sparse(cache, q, iq, pos, table):
        k, v = cache.get_kv_buffer(0)
        ik = ops.PagedKV(cache.get_index_k_buffer(0), table, block)
        sel = ops.indexer_select(iq, ik, pos, HEADS, block, topk, init_blocks=0, local_blocks=1)
        return ops.block_sparse_attention(
            q, ops.PagedKV(k, table, block), ops.PagedKV(v, table, block), pos, sel, block
        )

    dense_fn, sparse_fn = jax.jit(dense), jax.jit(sparse)
    for context in sizes.contexts:
        layout = jsk.SparseKVLayout(
            (), (0,), (0,), num_slots=context, page_size=block, head_num=HEADS, head_dim=DIM, index_head_dim=DIM,
            dtype=jnp.bfloat16,
        )  # fmt: skip
        cache = jsk.SparseKVCache.zeros(layout)
        slots = jnp.arange(block, block + context, dtype=jnp.int32)
        for start in range(0, context, 8192):  # fill in chunks
            s = slots[start : start + 8192]
            kv = jnp.asarray(rng.normal(size=(len(s), HEADS, DIM)), jnp.bfloat16)
            ik = jnp.asarray(rng.normal(size=(len(s), 1, DIM)), jnp.bfloat16)
            cache = cache.set_fused_kv_index_buffer(0, s, kv, kv, ik)
        table = jnp.asarray(np.arange(1, context // block + 1)[None], jnp.int32)
        q = jnp.asarray(rng.normal(size=(1, 1, q_heads, DIM)), jnp.float32)
        iq = jnp.asarray(rng.normal(size=(1, 1, index_heads, DIM)), jnp.float32)
        pos = jnp.array([[context - 1]], jnp.int32)
        t_dense = time_pure(dense_fn, cache, q, pos, table, repeats=sizes.repeats)
        t_sparse = time_pure(sparse_fn, cache, q, iq, pos, table, repeats=sizes.repeats)
        out["rows"].append(
            {
                "context": context,
                "dense": t_dense,
                "sparse": t_sparse,
                "speedup": t_dense["median"] / t_sparse["median"],
            }
        )
    return out


# ---------------------------------------------------------- 5. end to end


def end_to_end(sizes: Sizes) -> dict:
    from jax_sparse_kv.nn import DecodeSession, MiniMaxLikeModel, demo_config, make_step
    from jax_sparse_kv.paging import interleaved_page_table

    config = demo_config()
    model = MiniMaxLikeModel(config, seed=0)
    rng = np.random.default_rng(5)
    batch, prompt, steps = sizes.e2e_batch, sizes.e2e_prompt, sizes.e2e_steps
    prompts = [rng.integers(0, config.vocab_size, prompt).tolist() for _ in range(batch)]
    pages = -(-(prompt + steps) // 16)
    out: dict = {"batch": batch, "prompt": prompt, "steps": steps, "variants": {}}
    for name, dtype, scale in (("bf16", jnp.bfloat16, 1.0), ("fp8_e4m3", jnp.float8_e4m3fn, 0.5)):
        layout = config.layout(num_slots=batch * pages * 16, page_size=16, dtype=dtype)
        session = DecodeSession(
            make_step(model, kv_scale=scale), jsk.SparseKVCache.zeros(layout),
            jnp.asarray(interleaved_page_table(batch, pages)),
        )  # fmt: skip
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
