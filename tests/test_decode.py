"""The gold test: decoding through the cache equals a full forward pass without it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_kv import SparseKVCache
from jax_sparse_kv.nn import DecodeSession, KVPrecision, MiniMaxM3, make_forward, make_step, tiny_config
from jax_sparse_kv.nn.decode import pad_prompts

PAGE = 8
PROMPTS = [list(range(5, 18)), list(range(30, 37)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]
STEPS = 12
# interleaved pages: sequence b owns pages b+1, b+1+B, b+1+2B, ...
PAGE_TABLE = jnp.asarray(np.arange(1, 1 + 3 * 5).reshape(5, 3).T, jnp.int32)

# MiniMax-M3 at toy width; MLPs dense on dense-attention layers, MoE on sparse ones
CONFIGS = {
    # dense layer 0, sparse 1 and 3 K-only, sparse 2 with index V; 2 KV heads = 2 index heads
    "mixed": tiny_config("dsss", disable_index_value=(True, True, False, True)),
    # 4 KV heads = 4 index heads, top-2 blocks, both sparse layers with index V
    "four_heads_top2": tiny_config(
        "dsds",
        num_attention_heads=8,
        num_key_value_heads=4,
        index_n_heads=4,
        index_topk_blocks=2,
        disable_index_value=(True, False, True, False),
    ),
    # one KV head and one index head (MQA), the query's block and the one before it forced
    "shared_index_head": tiny_config("dss", num_key_value_heads=1, index_n_heads=1, index_local_blocks=2),
}

# (main dtype, index dtype, kv_scale, tolerance vs emulated rounding, tolerance vs plain f32)
# Against plain f32 the MoE routers see rounded K/V: a near-tied top-k flips an expert, which
# moves the toy model's small logits by ~1/3 of their maximum (measured: bf16 0.35, a router
# flip at one position), so the f32 bound of a rounding pool is 0.5 for bf16 too.
PRECISIONS = {
    "f32": ("float32", None, 1.0, 1e-5, 1e-5),
    "bf16": ("bfloat16", None, 0.5, 2e-3, 0.5),
    "fp8_e4m3+bf16_index": ("float8_e4m3fn", "bfloat16", 0.5, 5e-2, 0.5),
    "fp8_e5m2": ("float8_e5m2", None, 1.0, 5e-2, 1.0),
}


@functools.cache  # the isolation tests reuse the clean runs
def run_cached(config, dtype, index_dtype, scale, poison=None):
    model = MiniMaxM3(config, seed=0)
    layout = config.layout(num_slots=16 * PAGE, page_size=PAGE, dtype=dtype, index_dtype=index_dtype)
    cache = SparseKVCache.zeros(layout)
    if poison is not None:
        bits = dict(poison)
        cache = jax.tree.map(lambda b: jnp.full_like(b, bits[b.dtype.itemsize]), cache)
    step = make_step(model, kv_scale=scale)
    session = DecodeSession(step, cache, PAGE_TABLE)
    tokens, logits = session.generate(PROMPTS, STEPS)
    return model, layout, step, tokens, logits


def full_forward_logits(model, tokens, precision):
    """Logits at every generated position from one cache-free pass over prompt + generated."""
    full = [p + list(tokens[b, :-1]) for b, p in enumerate(PROMPTS)]
    ids, pos = pad_prompts(full)
    logits = make_forward(model, precision)(jnp.asarray(ids), jnp.asarray(pos))
    return [np.stack([np.asarray(logits[b, len(p) - 1 + i]) for b, p in enumerate(PROMPTS)]) for i in range(STEPS + 1)]


def rel_err(a, b):
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b, strict=True))


# every precision on the mixed model; f32 and fp8 on the other head/group arrangements
GOLD_CASES = [("mixed", p) for p in PRECISIONS] + [
    (c, p) for c in CONFIGS if c != "mixed" for p in ("f32", "fp8_e4m3+bf16_index")
]


@pytest.mark.slow  # 12-36 s a case: full forwards beside the cache; test_m3_reference checks cached decode too
@pytest.mark.parametrize("config, precision", GOLD_CASES)
def test_decode_through_cache_equals_full_forward(config, precision):
    dtype, index_dtype, scale, tol, tol_f32 = PRECISIONS[precision]
    config = CONFIGS[config]
    model, layout, step, tokens, logits = run_cached(config, dtype, index_dtype, scale)
    assert tokens.shape == (3, STEPS + 1)
    # Same rounding as the pools (K/V stored in `dtype`, read back times the scale):
    emulated = full_forward_logits(model, tokens, KVPrecision.of(layout, scale))
    assert rel_err(logits, emulated) <= tol
    # Against a pure-f32 forward the cache's rounding shows, within a looser bound.
    assert rel_err(logits, full_forward_logits(model, tokens, KVPrecision())) <= tol_f32
    # one program for the prefill shape and one for the decode shape, none per step
    assert step.compilations() == 2


POISONS = {
    "nan": ((1, 0xFF), (2, 0xFFFF), (4, 0xFFFFFFFF)),  # NaN in every float format here
    "huge": ((1, 0x7E), (2, 0x7BFF), (4, 0x7F7F7F7F)),  # 448 (e4m3) / 65504 (f16) / 3.4e38 (f32)
}


GARBAGE_CASES = [(d, p) for d in ("float32", "float16", "float8_e4m3fn") for p in POISONS]


@pytest.mark.slow  # ~17 s a case: a model decode per case; test_paged_decode's ops read NaN/inf garbage pools
@pytest.mark.parametrize("dtype, poison", GARBAGE_CASES)
def test_other_slots_holding_garbage_change_nothing(dtype, poison):
    config = CONFIGS["mixed"]
    _, _, _, tokens, logits = run_cached(config, dtype, None, 1.0)
    _, _, _, tokens_p, logits_p = run_cached(config, dtype, None, 1.0, poison=POISONS[poison])
    np.testing.assert_array_equal(tokens_p, tokens)
    for clean, dirty in zip(logits, logits_p, strict=True):
        np.testing.assert_array_equal(dirty, clean)
        assert np.isfinite(dirty).all()


def test_model_rejects_a_cache_of_another_shape():
    model = MiniMaxM3(CONFIGS["mixed"], seed=0)
    wrong = tiny_config("dsss", disable_index_value=(True, True, False, False)).layout(num_slots=64, page_size=PAGE)
    with pytest.raises(
        ValueError, match=r"cache layout does not match the model: k_only_layer_ids: model \(1, 3\), layout \(1,\)"
    ):
        model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), SparseKVCache.zeros(wrong), PAGE_TABLE[:1])


@pytest.mark.slow  # 10-15 s: return_selection compiles its own step; the gold tests compare selections too
def test_selection_is_sparse_and_returned():
    config = CONFIGS["mixed"]
    model = MiniMaxM3(config, seed=0)
    ids, pos = pad_prompts([list(range(40))])
    _, _, selections = model(jnp.asarray(ids), jnp.asarray(pos), return_selection=True)
    assert sorted(selections) == [1, 2, 3]
    sel = np.asarray(selections[1])  # [1, 40, index_heads, topk]
    assert sel.shape == (1, 40, 2, 3)
    last = sel[0, -1]  # position 39, block 4 of 5: its own (local) block forced, no init block in M3
    for head in last:
        assert 4 in head and len(set(head.tolist())) == 3 and set(head.tolist()) <= set(range(5))
    assert (sel[0, 0] == [0, -1, -1]).all()


@pytest.mark.slow  # ~10 s: a variant of the selection checks that stay
def test_two_local_blocks_are_forced():
    model = MiniMaxM3(CONFIGS["shared_index_head"], seed=0)
    ids, pos = pad_prompts([list(range(40))])
    _, _, selections = model(jnp.asarray(ids), jnp.asarray(pos), return_selection=True)
    assert sorted(selections) == [1, 2]
    for sel in map(np.asarray, selections.values()):
        assert sel.shape == (1, 40, 1, 3)
        for t in range(8, 40):  # the query's block and the one before it, whatever the scores
            assert {t // PAGE, t // PAGE - 1} <= set(sel[0, t, 0].tolist())
        assert (sel[0, 0, 0] == [0, -1, -1]).all()
        assert sorted(sel[0, 8, 0].tolist()) == [-1, 0, 1]
