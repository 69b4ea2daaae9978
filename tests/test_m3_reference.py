"""MiniMax-M3 against transformers' implementation, live (needs torch and transformers).

The same random weights run in transformers (`MiniMaxM3VLForCausalLM`, eager
attention) and here, loaded through `MiniMaxM3.from_pretrained` from a
checkpoint the reference wrote. Compared: prefill logits through the cache and
in the cache-free pass, greedy decode tokens and logits, and the blocks each
sparse layer's indexer selects per head and token (as sets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_sparse_kv.nn import MiniMaxM3, tiny_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.minimax_m3_vl")

from support.m3_reference import reference_greedy, reference_model, rel, run_ours, same_block_sets, save_reference  # noqa: E402

STEPS = 10
PROMPT_LEN = 37
BATCH = 2

# name -> (config, page_size); prompts of 37 tokens span 5-10 blocks, so top-k really chooses
CASES = {
    "dssd_local1_top2_2heads_page=block": (tiny_config("dssd", index_topk_blocks=2, index_local_blocks=1), 8),
    "sdss_local2_top3_1head_page<block": (
        tiny_config(
            "sdss",
            "mdmm",
            num_attention_heads=4,
            num_key_value_heads=1,
            index_n_heads=1,
            index_topk_blocks=3,
            index_local_blocks=2,
        ),
        4,
    ),
    "ssd_local2_top4_4heads_page>block_tied": (
        tiny_config(
            "ssd",
            num_attention_heads=8,
            num_key_value_heads=4,
            index_n_heads=4,
            index_block_size=4,
            index_topk_blocks=4,
            index_local_blocks=2,
            tie_word_embeddings=True,
            head_dim=32,
            rotary_dim=16,
            index_head_dim=8,
        ),
        16,
    ),
    "sds_local1_top3_3heads_bigger_mlp": (
        tiny_config(
            "sds",
            "mmd",
            num_attention_heads=6,
            num_key_value_heads=3,
            index_n_heads=3,
            num_local_experts=6,
            num_experts_per_tok=3,
            rotary_dim=16,
        ),
        8,
    ),
    # one KV head shared by two index heads: each query-head half follows its own selection
    "dsss_2_index_heads_per_kv_head": (
        tiny_config("dsss", num_attention_heads=4, num_key_value_heads=1, index_n_heads=2),
        8,
    ),
}
# the first runs by default; the rest (a transformers model and our decode each) with `pytest -m slow`
CASE_PARAMS = [c if i < 1 else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(CASES)]


@functools.cache
def prepared(case: str, tmp: str):
    config, page_size = CASES[case]
    ref = reference_model(config, seed=1)
    path = f"{tmp}/{case}"
    save_reference(ref, path)
    model = MiniMaxM3.from_pretrained(path)
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, config.vocab_size, size=(BATCH, PROMPT_LEN))
    return config, page_size, ref, model, prompts, reference_greedy(ref, prompts, STEPS)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("m3_reference"))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_prefill_and_greedy_decode_match_transformers(case, tmp_root):
    config, page_size, _, model, prompts, (ref_prefill, ref_steps, ref_tokens, ref_sel) = prepared(case, tmp_root)
    prefill, steps, tokens, selections = run_ours(model, prompts, STEPS, page_size)

    assert rel(prefill, ref_prefill) <= 1e-4
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert rel(steps, ref_steps) <= 1e-4
    assert set(selections) == set(ref_sel) == set(config.sparse_layer_ids)
    for layer in config.sparse_layer_ids:
        assert len(selections[layer]) == len(ref_sel[layer]) == STEPS + 1
        for ours, theirs in zip(selections[layer], ref_sel[layer], strict=True):
            assert same_block_sets(ours, theirs), f"layer {layer}: indexer selections differ"


@pytest.mark.slow  # a transformers model per case; the default case of the decode test compares prefill logits too
@pytest.mark.parametrize("case", list(CASES)[:2])
def test_cache_free_pass_matches_transformers(case, tmp_root):
    _, _, _, model, prompts, (ref_prefill, *_) = prepared(case, tmp_root)
    positions = jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape)
    with jax.default_matmul_precision("highest"):
        logits, _ = model(jnp.asarray(prompts), positions)
    assert rel(logits, ref_prefill) <= 1e-4


@pytest.mark.slow  # ~8 s: a broken model's prefill; the comparisons that stay use the same bound
def test_a_wrong_reading_would_be_caught(tmp_root):
    """The comparison has teeth: dropping the Gemma ``1 +`` of one norm moves logits far beyond the bound."""
    case = list(CASES)[0]
    _, page_size, _, model, prompts, (ref_prefill, *_) = prepared(case, tmp_root)
    broken = nnx.clone(model)
    norm = broken.layers[1].self_attn.q_norm
    norm.weight.set_value(norm.weight[...] - 1.0)  # (1 + w) -> w
    prefill, *_ = run_ours(broken, prompts, 0, page_size)
    assert rel(prefill, ref_prefill) > 1e-2


# Low-precision pools: the model stays f32, K/V are stored in the pool dtype. Measured on the
# first two cases (prefill, all positions), relative to the largest reference logit:
#   bf16:     median 0.003-0.005, max 0.27-0.53
#   fp8 e4m3: median 0.04-0.05,   max 0.53
#   fp8 e5m2: median 0.07-0.09,   max 0.53
# The max is not a rounding error of the cache: rounding K/V moves some hidden
# states across a routing or top-k boundary (a different expert, or another block),
# and with these sharp random weights one such flip moves a row's logits by tens of
# percent. The median measures the pool's rounding; the emulated-rounding gold test
# (tests/test_decode.py) bounds the cache itself much more tightly.
@pytest.mark.parametrize(
    "dtype, scale, bound",
    [
        pytest.param("bfloat16", 1.0, 2e-2, marks=pytest.mark.slow),  # ~9 s; the fp8 pools' case stays
        ("float8_e4m3fn", 0.5, 0.15),
    ],
)
def test_low_precision_pools_stay_close_to_transformers(dtype, scale, bound, tmp_root):
    case = list(CASES)[0]
    _, page_size, _, model, prompts, (ref_prefill, *_) = prepared(case, tmp_root)
    prefill, *_ = run_ours(model, prompts, 0, page_size, dtype=dtype, kv_scale=scale)
    per_row = np.abs(prefill - ref_prefill).max(-1) / np.abs(ref_prefill).max()
    assert 0 < np.median(per_row) <= bound  # > 0: the pool really rounds
