"""The serving engine against the model's own greedy decode of each prompt alone (and so transformers').

The model is the tiny random M3 of tests/fixtures/m3, whose transformers
greedy tokens are recorded; the solo reference is `make_step` on one prompt
at a time (tests/support/serving_reference.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.serving_reference import (
    PAGE,
    SoloGreedy,
    assert_idle,
    fixture_model,
    make_engine,
    one_bucket,
    random_prompts,
    solo_greedy,
    transformers_reference,
)

from jax_sparse_kv import SparseKVCache, serving
from jax_sparse_kv.ops.ragged import ragged_token_rows
from jax_sparse_kv.serving.kv_cache_manager import KVCacheManager
from jax_sparse_kv.serving.sampler import SamplingRows, filtered_logits, sample
from jax_sparse_kv.serving.speculative import ngram_drafts

STEPS = 10
LENGTHS = (1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 33, 50)  # across index blocks (4) and pages (8)


@pytest.fixture(scope="module")
def model():
    return fixture_model("flat")


@pytest.fixture(scope="module")
def solo(model):
    return solo_greedy(model)


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model)


# ------------------------------------------------------------------ greedy equals the model alone


@pytest.mark.parametrize(
    "spelling",
    ["flat", pytest.param("original_sharded", marks=pytest.mark.slow)],  # ~10 s; flat's weights (test_m3_fixtures)
)
def test_engine_gives_transformers_tokens(spelling, engine):
    ref = transformers_reference()
    # 21-token prompts run in chunks (token budget 16 with the module's engine, 8 with the other spelling's)
    eng = engine if spelling == "flat" else make_engine(fixture_model(spelling), max_tokens_per_step=8)
    steps = ref["tokens"].shape[1]
    outs = eng.generate([list(p) for p in ref["prompts"]], serving.SamplingParams(max_tokens=steps))
    np.testing.assert_array_equal(np.array([o.token_ids for o in outs]), ref["tokens"])
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.slow  # 8-60 s: its own engine; transformers' recorded tokens stay
def test_many_prompts_at_once_equal_solo_decode(engine, solo, model):
    prompts = random_prompts(np.random.default_rng(0), LENGTHS, model.config.vocab_size)
    outs = engine.generate(prompts, serving.SamplingParams(max_tokens=STEPS))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == solo(prompt, STEPS), len(prompt)
    assert_idle(engine)


@pytest.mark.slow  # ~84 s: many engine steps; transformers' recorded tokens stay
def test_staggered_arrivals_equal_solo_decode(engine, solo, model):
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, (20, 5, 40, 9, 2, 26), model.config.vocab_size)
    steps = [4, 12, 7, 10, 3, 9]
    done, pending = {}, list(zip(prompts, steps, strict=True))
    ids = {}
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            prompt, n = pending.pop(0)
            ids[engine.add_request(prompt, serving.SamplingParams(max_tokens=n))] = (prompt, n)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert len(done) == len(prompts)
    for rid, (prompt, n) in ids.items():
        assert done[rid] == solo(prompt, n)
    assert_idle(engine)


def test_outputs_stream_token_by_token(engine, solo, model):
    prompt = random_prompts(np.random.default_rng(2), (13,), model.config.vocab_size)[0]
    rid = engine.add_request(prompt, serving.SamplingParams(max_tokens=6))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            assert out.token_ids == seen + out.new_token_ids
            seen = out.token_ids
            assert out.finished == (len(seen) == 6)
    assert seen == solo(prompt, 6)


# ------------------------------------------------------------------ chunked prefill, preemption, prefix sharing


@pytest.mark.slow  # 10-13 s: its own engine
def test_chunked_prefill_chooses_the_blocks_of_one_whole_prefill(model):
    """Ragged chunks through the cache: every sparse layer's indexer picks, per query, the whole prefill's blocks."""
    c = model.config
    length, chunks = 37, (5, 16, 16)
    tokens = np.random.default_rng(3).integers(0, c.vocab_size, length)
    pages = -(-length // PAGE)
    layout = c.layout(num_slots=pages * PAGE, page_size=PAGE, dtype=jnp.float32)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]

    whole_logits, _, whole = model(
        jnp.asarray(tokens)[None], jnp.arange(length)[None], SparseKVCache.zeros(layout), table, return_selection=True
    )
    cache, start, logits, sel = SparseKVCache.zeros(layout), 0, [], {i: [] for i in c.sparse_layer_ids}
    for n in chunks:
        seq, pos, rows = ragged_token_rows(jnp.asarray([0, n]), jnp.asarray([start + n]), table, 16)
        tok = jnp.zeros(16, jnp.int32).at[:n].set(jnp.asarray(tokens[start : start + n]))
        out, cache, s = model(tok[:, None], pos[:, None], cache, rows, return_selection=True)
        logits.append(out[:n, 0])
        for layer in c.sparse_layer_ids:
            sel[layer].append(s[layer][:n, 0])
        start += n
    for layer in c.sparse_layer_ids:
        ours = np.concatenate(sel[layer])  # [tokens, index_heads, topk]
        ref = np.asarray(whole[layer][0])
        assert ours.shape == ref.shape
        for t in range(length):
            for h in range(ours.shape[1]):
                assert set(ours[t, h]) == set(ref[t, h]), (layer, t, h)
    np.testing.assert_allclose(np.concatenate(logits), whole_logits[0], atol=1e-5)


def test_ragged_token_rows():
    seq, pos, table = ragged_token_rows(
        jnp.asarray([0, 1, 4, 4, 6]), jnp.asarray([10, 3, 0, 9]), jnp.asarray([[1, 2], [3, 0], [0, 0], [4, 5]]), 8
    )
    np.testing.assert_array_equal(seq, [0, 1, 1, 1, 3, 3, 0, 0])
    np.testing.assert_array_equal(pos, [9, 0, 1, 2, 7, 8, -1, -1])
    np.testing.assert_array_equal(table[:, 0], [1, 3, 3, 3, 4, 4, 0, 0])


@pytest.mark.slow  # six long requests run to their end under preemption: ~40 s (the default run stays near 5 minutes)
def test_a_short_request_is_served_while_long_ones_overfill_the_cache(model, solo):
    """Issue 43's silent streams in small: long requests that together need far more pages than there are, then a
    short one. It starts once a long one gives way and is never the one preempted after (the victim is the request
    with the most output still to generate), so it ends within a few steps, not after the long ones."""
    eng = make_engine(model, num_pages=24, max_seqs=8, max_tokens_per_step=16)  # 6 x 19 pages wanted, 24 there
    rng = np.random.default_rng(7)
    long = serving.SamplingParams(max_tokens=140, ignore_eos=True)
    for prompt in random_prompts(rng, (10,) * 6, model.config.vocab_size):
        eng.add_request(prompt, long)
    while eng.stats().preemptions == 0:
        eng.step()
    short = random_prompts(rng, (5,), model.config.vocab_size)[0]
    rid = eng.add_request(short, serving.SamplingParams(max_tokens=4))
    steps, done = 0, []
    while not done and steps < 40:
        steps += 1
        done = [o for o in eng.step() if o.request_id == rid and o.finished]
    assert done and steps <= 12, f"the short request took {steps} steps"
    assert done[0].token_ids == solo(short, 4)
    while eng.has_unfinished_requests():  # and the long ones still end, nothing lost
        eng.step()
    assert_idle(eng)


def test_n_children_are_seeded_and_share_the_prompt(model):
    """SamplingParams(n=3): three child requests {id}-{i}, child i seeded seed + i (so each equals a lone request
    with that seed), the later ones starting after the first computed the prompt: they read its full pages."""
    eng = make_engine(model)
    prompt = list(range(5, 22))  # two full pages of 8, then one token
    params = serving.SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    outs = eng.generate([prompt, [3, 4, 5]], params)
    assert [o.request_id for o in outs] == [f"req-{k}-{i}" for k in range(2) for i in range(3)]
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 2 * PAGE, 2 * PAGE]
    lone = [eng.generate([prompt], dataclasses.replace(params, n=1, seed=11 + i))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in outs[:3]] == lone and len({tuple(t) for t in lone}) > 1
    rid = eng.add_request(prompt, dataclasses.replace(params, max_tokens=50), request_id="p")
    assert eng.request_ids(rid) == ["p-0", "p-1", "p-2"]
    with pytest.raises(ValueError, match="'p-0' is already in use"):
        eng.add_request([1, 2], params, request_id="p-0")
    eng.step()
    eng.abort("p")  # the parent's id aborts every child
    aborted = {o.request_id: o.finish_reason for o in eng.step()}
    assert aborted == {"p-0": "abort", "p-1": "abort", "p-2": "abort"}
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        eng.add_request([1, 2], serving.SamplingParams(n=0))
    assert_idle(eng)


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(model):
    """SamplingParams(prompt_logprobs=k): the prompt's own token and the top k per position, from a cache-free
    pass. Scoring a prompt P + (t0, t1, t2) gives at t0..t2's positions what the engine's paged steps reported
    for them while generating t0..t2 from P (two code paths, one model)."""
    eng = make_engine(model)
    prompt = random_prompts(np.random.default_rng(5), (23,), model.config.vocab_size)[0]
    gen = eng.generate([prompt], serving.SamplingParams(max_tokens=3, logprobs=3))[0]
    scored = eng.generate([prompt + gen.token_ids], serving.SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    entries = scored.prompt_logprobs
    assert len(entries) == len(prompt) + 3 and entries[0] is None
    for i, (token, sampled) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        entry = entries[len(prompt) + i]
        assert next(iter(entry)) == token and entry[token][1] == 1  # greedy: the prompt's token ranks first
        assert set(entry) == set(sampled)  # the chosen token and the top 3, as the step reported
        for t, lp in sampled.items():
            np.testing.assert_allclose(entry[t][0], lp, atol=2e-3)
    assert all(1 <= rank for e in entries[1:] for _, rank in e.values())
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        eng.add_request([1, 2], serving.SamplingParams(prompt_logprobs=99))
    assert_idle(eng)


@pytest.mark.slow  # 10-13 s: an engine under preemption
def test_preemption_loses_nothing(model, solo):
    eng = make_engine(model, num_pages=10)  # four requests of 5 pages each cannot all run
    prompts = random_prompts(np.random.default_rng(4), (20, 18, 22, 19), model.config.vocab_size)
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=18))
    assert eng.stats().preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == solo(prompt, 18)
    assert_idle(eng)


def test_prefix_sharing_reuses_full_pages_only(engine, solo, model):
    rng = np.random.default_rng(5)
    system = random_prompts(rng, (27,), model.config.vocab_size)[0]  # 3 full pages + 3 tokens
    prompts = [system + s for s in random_prompts(rng, (3, 9, 1), model.config.vocab_size)]
    before = engine.stats().prefix_cache_hit_tokens
    first = engine.generate(prompts[:1], serving.SamplingParams(max_tokens=STEPS))
    rest = engine.generate(prompts[1:], serving.SamplingParams(max_tokens=STEPS))
    hits = engine.stats().prefix_cache_hit_tokens - before
    assert hits == 2 * 24  # the 3 full pages of the shared prefix, for each later request; never the partial page
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out.token_ids == solo(prompt, STEPS)
    # the same prompt again: every full page is cached, but its last token is always recomputed
    again = engine.generate(prompts[:1], serving.SamplingParams(max_tokens=STEPS))
    assert again[0].token_ids == first[0].token_ids
    assert engine.stats().prefix_cache_hit_tokens - before - hits == (len(prompts[0]) - 1) // PAGE * PAGE
    assert_idle(engine)


@pytest.mark.slow  # 10-13 s: its own engine; prefix sharing stays
def test_prefix_of_exactly_full_pages_recomputes_its_last_page(model, solo):
    eng = make_engine(model)
    prompt = random_prompts(np.random.default_rng(6), (16,), model.config.vocab_size)[0]
    a = eng.generate([prompt], serving.SamplingParams(max_tokens=4))
    b = eng.generate([prompt], serving.SamplingParams(max_tokens=4))
    assert eng.stats().prefix_cache_hit_tokens == 8  # page 2 holds the last prompt token: not shared
    assert a[0].token_ids == b[0].token_ids == solo(prompt, 4)


def test_kv_cache_manager_books():
    kv = KVCacheManager(num_pages=4, page_size=2)
    a = kv.allocate(3)
    assert a == [1, 2, 3] and kv.allocate(2) is None and kv.available == 1
    h1 = kv.register(a[0], None, [5, 6])
    h2 = kv.register(a[1], h1, [7, 8])
    assert kv.match([5, 6, 7, 8, 9], max_pages=2) == ([1, 2], [h1, h2])
    assert kv.match([5, 6, 7, 9], max_pages=2) == ([1], [h1])  # a different second page breaks the chain
    assert kv.match([7, 8], max_pages=2) == ([], [])  # same tokens, other parent: no hit
    kv.release(a)
    assert (kv.free_pages, kv.cached_pages) == (2, 2)  # page 3 held no full page: free; 1 and 2 cached
    kv.share([1])
    assert kv.cached_pages == 1 and kv.refcount[1] == 1
    taken = kv.allocate(3)  # the free pages first, then the least recently used cached page (2)
    assert sorted(taken) == [2, 3, 4] and kv.match([5, 6, 7, 8], 2) == ([1], [h1])
    kv.check()
    with pytest.raises(AssertionError, match="released more often"):
        kv.release([1, 1])


# ------------------------------------------------------------------ sampling


@pytest.mark.slow  # 10-13 s: its own engine; the sampler's distribution stays
def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = serving.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234)
    prompt = random_prompts(np.random.default_rng(7), (11,), model.config.vocab_size)[0]
    alone = make_engine(model).generate([prompt], params)[0].token_ids
    crowd = random_prompts(np.random.default_rng(8), (30, 2, 17), model.config.vocab_size)
    eng = make_engine(model, num_pages=8, max_tokens_per_step=8)  # other requests, other chunking, preemption
    outs = eng.generate(
        crowd[:2] + [prompt] + crowd[2:],
        [serving.SamplingParams(max_tokens=20)] * 2
        + [params]
        + [serving.SamplingParams(max_tokens=20, temperature=1.0)],
    )
    assert outs[2].token_ids == alone
    assert eng.stats().preemptions > 0
    unseeded = make_engine(model).generate([prompt] * 2, dataclasses.replace(params, seed=None))
    assert len({tuple(o.token_ids) for o in unseeded + outs[2:3]}) > 1  # without a seed, draws differ


def test_top_k_1_is_greedy(engine, solo, model):
    prompt = random_prompts(np.random.default_rng(9), (14,), model.config.vocab_size)[0]
    out = engine.generate([prompt], serving.SamplingParams(max_tokens=6, temperature=2.0, top_k=1, seed=3))
    assert out[0].token_ids == solo(prompt, 6)


def test_sampler_draws_from_the_filtered_distribution():
    logits = jnp.asarray([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    n = 6000
    rows = SamplingRows.from_numpy(
        np.full(n, 0.7),
        np.full(n, 4),
        np.full(n, 0.95),
        np.full(n, 0.05),
        np.full(n, 11),
        np.arange(n),
        logprobs=np.full(n, 3),
    )
    tokens, chosen, top_ids, top_lp = jax.jit(sample, static_argnums=2)(jnp.tile(logits, (n, 1)), rows, 3)
    # expected: temperature, then top-4, then the smallest set reaching 0.95, then >= 0.05 x the best
    p = np.exp(np.asarray(logits) / 0.7)
    p /= p.sum()
    keep = np.arange(6) < 4
    keep &= (np.cumsum(p) - p) < 0.95
    keep &= p >= 0.05 * p[0]
    expected = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[~keep].sum() == 0
    live = keep & (expected > 0)
    chi2 = (((counts[live] - n * expected[live]) ** 2) / (n * expected[live])).sum()
    assert chi2 < 16.3, (counts, n * expected)  # p = 0.001 at 3 degrees of freedom
    lp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(chosen), lp[np.asarray(tokens)], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(top_ids[0]), [0, 1, 2])
    np.testing.assert_allclose(np.asarray(top_lp[0]), lp[:3], rtol=1e-6)
    masked = np.asarray(filtered_logits(logits[None], SamplingRows.from_numpy([1.0], [1], [1.0], [0.0], [0], [0])))
    assert np.isfinite(masked).sum() == 1 and np.isfinite(masked[0, 0])


def test_filters_without_a_sort_keep_what_the_sort_keeps():
    """Top-k and top-p as thresholds found by bisection keep the set the sort-based reference keeps (no ties here),
    for every mix of filters, rows differing in a batch; rows without top-k/top-p skip the search."""
    from jax_sparse_kv.serving.sampler import ranked_filters

    rng = np.random.default_rng(5)
    for trial in range(4):
        logits = jax.random.normal(jax.random.key(trial), (24, 700)) * (1.0 + 2 * trial)
        rows = SamplingRows.from_numpy(
            rng.uniform(0.3, 1.5, 24),
            rng.choice([0, 1, 3, 40, 300], 24),
            rng.choice([1.0, 0.95, 0.6, 0.2], 24),
            rng.choice([0.0, 0.01, 0.3], 24),
            np.arange(24),
            np.zeros(24),
        )
        ours = np.asarray(jax.jit(filtered_logits)(logits, rows))
        scaled = logits / np.asarray(rows.temperature)[:, None]
        # the reference's top-p 1 stops once its f32 running sum rounds to 1 (dropping the tail): no top-p is 2 there
        no_top_p = SamplingRows(**{**rows.__dict__, "top_p": jnp.where(rows.top_p >= 1.0, 2.0, rows.top_p)})
        want = np.asarray(ranked_filters(scaled, no_top_p))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(want), err_msg=f"trial {trial}")
        np.testing.assert_allclose(ours[np.isfinite(ours)], np.asarray(scaled)[np.isfinite(ours)], rtol=1e-6)
    greedyish = SamplingRows.from_numpy([1.0], [1], [1.0], [0.0], [0], [0])
    assert np.isfinite(np.asarray(filtered_logits(logits[:1], greedyish))).sum() == 1  # top-k 1: the best alone
    plain = SamplingRows.from_numpy([1.0], [0], [1.0], [0.0], [0], [0])
    assert np.isfinite(np.asarray(filtered_logits(logits[:1], plain))).all()  # no filter: every token


def test_logprobs_only_when_a_row_asks_and_the_tokens_do_not_change():
    logits = jax.random.normal(jax.random.key(4), (4, 300)) * 2
    base = dict(
        temperature=np.full(4, 0.9),
        top_k=np.zeros(4),
        top_p=np.ones(4),
        min_p=np.zeros(4),
        seed=np.arange(4),
        position=np.zeros(4),
    )
    none = jax.jit(sample, static_argnums=2)(logits, SamplingRows.from_numpy(**base), 5)
    asked = jax.jit(sample, static_argnums=2)(logits, SamplingRows.from_numpy(**base, logprobs=[-1, 5, -1, -1]), 5)
    np.testing.assert_array_equal(np.asarray(none[0]), np.asarray(asked[0]))  # same draws
    assert not np.asarray(none[1]).any() and not np.asarray(none[3]).any()  # nothing computed
    lp = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(asked[1]), lp[np.arange(4), np.asarray(asked[0])], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(asked[2]), np.argsort(-lp, axis=-1)[:, :5])


@pytest.mark.slow  # 8-60 s: its own engine and reference
def test_logprobs_are_the_models(engine, model):
    prompt = random_prompts(np.random.default_rng(10), (9,), model.config.vocab_size)[0]
    out = engine.generate([prompt], serving.SamplingParams(max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    full = prompt + out.token_ids[:-1]
    logits, _ = model(jnp.asarray([full]), jnp.arange(len(full))[None])
    lp = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1 :]))
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top3 = np.argsort(-lp[i])[:3]
        assert set(entry) == set(top3) | {token}
        for t, v in entry.items():
            assert abs(v - lp[i, t]) < 1e-4


def test_host_time_is_split_by_phase_and_adds_up(engine, model):
    """EngineStats' phases (schedule, prepare, dispatch, wait, commit, output) are each measured and together stay
    within the wall time of the steps."""
    import time

    prompts = random_prompts(np.random.default_rng(12), (9, 20), model.config.vocab_size)
    before = engine.stats()
    t0 = time.perf_counter()
    engine.generate(prompts, serving.SamplingParams(max_tokens=5))
    wall = time.perf_counter() - t0
    after = engine.stats()
    phases = {
        p: getattr(after, f"{p}_seconds") - getattr(before, f"{p}_seconds")
        for p in ("schedule", "prepare", "dispatch", "wait", "commit", "output")
    }
    assert all(v > 0 for v in phases.values()), phases
    assert sum(phases.values()) <= wall
    assert abs((after.step_seconds - before.step_seconds) - phases["dispatch"] - phases["wait"]) < 1e-9


@pytest.mark.slow  # ~20 s: its own engine; the server's logit_bias test stays
def test_logit_bias_and_min_tokens_against_a_numpy_step(engine, model):
    """logit_bias changes the choice exactly as NumPy's argmax of (the model's logits + bias) says, logprobs stay
    the model's; min_tokens keeps the stop tokens out until then; a step with biases compiles one more program."""
    prompt = random_prompts(np.random.default_rng(11), (12,), model.config.vocab_size)[0]
    logits, _ = model(jnp.asarray([prompt]), jnp.arange(len(prompt))[None])
    last = np.asarray(logits[0, -1], np.float64)
    order = np.argsort(-last)
    bias = {int(order[0]): -3.0, int(order[2]): 2.5, int(order[40]): 1.0}
    biased = last.copy()
    for t, b in bias.items():
        biased[t] += b
    (out,) = engine.generate([prompt], serving.SamplingParams(max_tokens=1, logit_bias=bias, logprobs=2))
    assert out.token_ids == [int(np.argmax(biased))] and out.token_ids != [int(order[0])]
    lp = np.asarray(jax.nn.log_softmax(logits[0, -1]))
    assert all(abs(v - lp[t]) < 1e-4 for t, v in out.logprobs[0].items())  # the model's, not the biased ones
    (forced,) = engine.generate([prompt], serving.SamplingParams(max_tokens=3, logit_bias={7: 100.0}))
    assert forced.token_ids == [7, 7, 7]
    # min_tokens: the greedy first token made a stop token ends the request at once, unless min_tokens holds it
    first = int(order[0])
    (stopped,) = engine.generate([prompt], serving.SamplingParams(max_tokens=5, stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    (held,) = engine.generate([prompt], serving.SamplingParams(max_tokens=5, stop_token_ids=[first], min_tokens=3))
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    assert held.token_ids[0] == int(order[1])  # the next best
    for bad, match in [
        (dict(logit_bias={model.config.vocab_size: 1.0}), "logit_bias has token id"),
        (dict(logit_bias={1: 101.0}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
        (dict(min_tokens=9, max_tokens=4), "min_tokens=9 is more than max_tokens=4"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, serving.SamplingParams(**{"max_tokens": 4, **bad}))


# ------------------------------------------------------------------ stops, abort, bad input, compilations


@pytest.mark.slow  # 8-60 s: its own engine
def test_stop_token_eos_and_max_tokens(engine, solo, model):
    prompt = random_prompts(np.random.default_rng(11), (10,), model.config.vocab_size)[0]
    ref = solo(prompt, 8)
    stop = ref[3]
    out = engine.generate([prompt], serving.SamplingParams(max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
    eng = make_engine(model)
    eng.config = dataclasses.replace(model.config, eos_token_id=(stop,))
    out = eng.generate([prompt], serving.SamplingParams(max_tokens=8))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    out = eng.generate([prompt], serving.SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == ref


def test_abort_frees_pages_and_reports(engine, model):
    prompt = random_prompts(np.random.default_rng(12), (30,), model.config.vocab_size)[0]
    rid = engine.add_request(prompt, serving.SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().running == 1
    engine.abort(rid)
    engine.abort(rid)  # twice, or an unknown id: nothing happens
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert_idle(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], {}, "prompt_token_ids"),
        ([1, 128], {}, "prompt_token_ids"),
        ([-1], {}, "prompt_token_ids"),
        ([[1, 2]], {}, "prompt_token_ids"),
        ([1] * 150, {"max_tokens": 11}, "max_model_len"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_k": -1}, "top_k"),
        ([1, 2], {"min_p": 2.0}, "min_p"),
        ([1, 2], {"logprobs": 100}, "logprobs"),
    ],
)
def test_bad_requests_are_rejected_and_change_nothing(engine, prompt, params, field):
    before = engine.stats()
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, serving.SamplingParams(**params))
    assert engine.stats() == before
    assert engine.generate([[1, 2, 3]], serving.SamplingParams(max_tokens=2))[0].finished


@pytest.mark.slow  # 8-60 s: its own engine; bad input stays in the default run
def test_requests_that_never_fit_or_repeat_an_id_are_rejected(model):
    eng = make_engine(model, num_pages=4)
    with pytest.raises(ValueError, match="num_pages=4: it could never fit"):
        eng.add_request([1] * 30, serving.SamplingParams(max_tokens=10))
    eng.add_request([1, 2], serving.SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="request_id='a' is already in use"):
        eng.add_request([1, 2], serving.SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="max_seqs must be an int >= 1"):
        make_engine(model, max_seqs=0)
    assert [o.token_ids for o in eng.generate([[3, 4]], serving.SamplingParams(max_tokens=2))] != []
    assert_idle(eng)


@pytest.mark.slow  # 10-13 s: warms up every bucket of its own engine
def test_second_run_compiles_nothing_and_warmup_covers_every_bucket(model):
    defaults = dict(token_buckets=None, seq_buckets=None, decode_programs=True)  # the engine's own buckets
    eng = make_engine(model, max_seqs=2, max_tokens_per_step=16, **defaults)
    compiled = eng.warmup(progress=False)
    # the default buckets: tokens {8, 16} x seqs {1, 2}, and decode-only programs for 1 and 2 sequences
    assert compiled == eng.stats().compilations == len(eng.shapes.programs()) == 6
    prompts = random_prompts(np.random.default_rng(13), (3, 17, 6), model.config.vocab_size)
    first = eng.generate(prompts, serving.SamplingParams(max_tokens=5))
    second = eng.generate(prompts, serving.SamplingParams(max_tokens=5))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert eng.stats().compilations == compiled


def test_warmup_stops_before_the_process_runs_out_of_memory_maps(solo, model, monkeypatch, caplog):
    """XLA:CPU maps hundreds of regions per compiled program: warmup stops (with a warning) while the process
    still has `MAP_RESERVE` regions left, instead of failing in the compiler; the engine then compiles on use."""
    from jax_sparse_kv.serving import engine as engine_module

    engine = make_engine(model, decode_programs=True)  # two programs: a mixed one and a decode-only one
    runs = []
    run_empty = engine.runner.run_empty
    monkeypatch.setattr(engine.runner, "run_empty", lambda *a: (runs.append(a), run_empty(*a))[1])
    # a process that loses 800 maps per program, with room for one before the reserve
    monkeypatch.setattr(
        engine_module, "memory_map_headroom", lambda: engine_module.MAP_RESERVE + 1000 - 800 * len(runs)
    )
    with caplog.at_level("WARNING", logger="jax_sparse_kv.serving.engine"):
        assert engine.warmup(progress=False) == len(runs) == 1 < len(engine.shapes.programs())
    assert "warmup stopped after 1 of" in caplog.text and "vm.max_map_count" in caplog.text
    prompt = random_prompts(np.random.default_rng(30), (11,), model.config.vocab_size)[0]
    assert engine.generate([prompt], serving.SamplingParams(max_tokens=4))[0].token_ids == solo(prompt, 4)


# ------------------------------------------------------------------ speculative decoding


def test_ngram_drafts():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 1) == [7, 5]  # latest earlier match wins
    assert ngram_drafts([4, 5, 6], 3, 3, 1) == []
    assert ngram_drafts([8, 1, 8], 4, 2, 1) == [1, 8]


def test_the_ngram_index_drafts_what_the_whole_context_scan_drafts():
    """`NgramIndex`, updated token by token, proposes exactly `ngram_drafts` of the whole sequence at every
    length (random sequences over small vocabularies, so n-grams repeat; several n-gram ranges)."""
    from jax_sparse_kv.serving.speculative import NgramIndex

    rng = np.random.default_rng(3)
    for trial in range(60):
        tokens = rng.integers(0, 2 + trial % 5, 80).tolist()
        lo, hi = sorted(rng.integers(1, 5, 2).tolist())
        k = int(rng.integers(1, 6))
        index = NgramIndex(lo, hi)
        size = 1
        while size <= len(tokens):
            expected = ngram_drafts(tokens[:size], k, hi, lo)
            assert index.drafts(lambda a, b, t=tokens: t[a:b], size, k) == expected, (trial, size)
            size += int(rng.integers(1, 4))  # one token or several (accepted drafts) at a time


@pytest.mark.slow  # 10-13 s a case: engines on low-precision pools
@pytest.mark.parametrize("dtype, kv_scale", [(jnp.bfloat16, 1.0), (jnp.float8_e4m3fn, 0.5)])
def test_low_precision_pools_equal_solo_decode_with_the_same_pools(model, dtype, kv_scale):
    """bf16 / fp8 pools: the engine rounds K/V exactly as make_step with the same pools does."""
    solo = SoloGreedy(model, dtype=dtype, kv_scale=kv_scale)
    eng = make_engine(model, dtype=dtype, kv_scale=kv_scale)
    prompts = random_prompts(np.random.default_rng(15), (5, 18, 33), model.config.vocab_size)
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=8))
    assert eng.runner.cache.layout.dtype == np.dtype(dtype)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == solo(prompt, 8)


def test_programs_cover_more_sequences_than_the_token_budget():
    """max_seqs above max_tokens_per_step: a decode-only step has at most the budget's tokens (warmup used to fail)."""
    from jax_sparse_kv.serving.model_runner import StepShapes, buckets

    shapes = StepShapes(buckets(8, 8), buckets(1, 16), rows_per_seq=1, table_width=4)
    assert shapes.programs() == [(8, s, d, 1, 4) for d in (False, True) for s in (1, 2, 4, 8)]


def test_given_buckets_bound_the_programs_and_bad_ones_are_refused(model):
    """``token_buckets`` / ``seq_buckets``: the step sizes are those given, the engine's limit added; each program
    pads to one of them (the serving tests run on one bucket each and match the solo decode)."""
    eng = make_engine(model, max_seqs=4, max_tokens_per_step=16, token_buckets=[4], seq_buckets=(2,))
    assert (eng.shapes.token_buckets, eng.shapes.seq_buckets) == ((4, 16), (2, 4))
    assert {(t, s) for t, s, *_ in eng.shapes.programs()} == {(4, 2), (4, 4), (16, 2), (16, 4)}
    one = make_engine(model)  # decode steps run the mixed program (decode_programs=False): one program
    assert (one.shapes.token_buckets, one.shapes.seq_buckets) == ((16,), (4,))
    assert one.shapes.programs() == [(16, 4, False, 1, one.shapes.table_width)]
    assert [p[2] for p in make_engine(model, decode_programs=True).shapes.programs()] == [False, True]
    default = make_engine(model, token_buckets=None, seq_buckets=None)
    assert (default.shapes.token_buckets, default.shapes.seq_buckets) == ((8, 16), (1, 2, 4))
    for bad, message in [
        (dict(token_buckets=[16, 8]), r"token_buckets must be ascending ints in 1\.\.max_tokens_per_step \(16\)"),
        (dict(token_buckets=[32]), r"token_buckets must be ascending ints in 1\.\.max_tokens_per_step \(16\)"),
        (dict(seq_buckets=[0, 4]), r"seq_buckets must be ascending ints in 1\.\.max_seqs \(4\)"),
        (dict(seq_buckets=[2, 2]), r"seq_buckets must be ascending"),
        (dict(seq_buckets=[]), r"seq_buckets must be a non-empty sequence of ints, got \[\]"),
        (dict(token_buckets=[8.0]), r"token_buckets must be a non-empty sequence of ints"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_engine(model, **bad)


def test_short_runs_attend_as_decode_rows_the_rest_in_query_blocks():
    """``row_tokens``: a sequence with at most that many new tokens (a verification) gives one decode row of
    ``row_tokens`` queries (its tokens, then padding), a longer one (a prefill chunk) query blocks; a step of
    short runs only has no blocks, and the programs cover rows-only steps of up to ``max_seqs * row_tokens``
    tokens."""
    from jax_sparse_kv.serving.model_runner import StepShapes, buckets

    shapes = StepShapes(buckets(8, 32), buckets(1, 4), rows_per_seq=4, table_width=4, query_block=8, row_tokens=4)
    cu = np.array([0, 3, 15, 16, 16], np.int32)  # 3 tokens, a chunk of 12, one token, a padding sequence
    decode, decode_seq, blocks, block_seq = shapes._groups([None] * 3, cu, 16, 4)
    assert decode.shape == (4, 4) and decode[:2].tolist() == [[0, 1, 2, 16], [15, 16, 16, 16]]
    assert (decode[2:] == 16).all() and decode_seq[:2].tolist() == [0, 2]
    assert blocks[:2].tolist() == [list(range(3, 11)), [11, 12, 13, 14, 16, 16, 16, 16]] and (blocks[2:] == 16).all()
    assert block_seq[:2].tolist() == [1, 1]
    cu = np.array([0, 4, 8, 9, 13], np.int32)  # every sequence verifies (or decodes): rows only
    decode, decode_seq, blocks, _ = shapes._groups([None] * 4, cu, 16, 4)
    assert blocks.shape[0] == 0 and decode.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 16, 16, 16], [9, 10, 11, 12]]
    assert decode_seq.tolist() == [0, 1, 2, 3]
    rows_only = {(t, s) for t, s, r, _, _ in shapes.programs() if r}
    assert max(t for t, _ in rows_only) == 16 and (16, 4) in rows_only
    # a row is as wide as the step's longest row sequence needs (1, 2 or 4 queries): a decode step of this
    # engine has rows of one query, as a plain engine's; every width has its programs
    assert shapes.row_buckets == (1, 2, 4) and {r for *_, r, _ in shapes.programs()} == {1, 2, 4}
    decode, decode_seq, blocks, _ = shapes._groups([None] * 3, np.array([0, 1, 2, 3, 3]), 8, 4)
    assert decode.shape == (4, 1) and decode[:3, 0].tolist() == [0, 1, 2] and decode_seq[:3].tolist() == [0, 1, 2]
    decode, _, blocks, _ = shapes._groups([None] * 3, np.array([0, 1, 3, 4, 4]), 8, 4)  # one verifies a draft
    assert decode.shape == (4, 2) and decode[:3].tolist() == [[0, 8], [1, 2], [3, 8]] and blocks.shape[0] == 0
    one = StepShapes(buckets(8, 32), buckets(1, 4), rows_per_seq=1, table_width=4, query_block=8)
    assert max(t for t, _, r, _, _ in one.programs() if r) == 8 and one.group_shapes(16, 4)[2:] == (4, 1)
    # without decode programs: the same verification step in the mixed program (its blocks all padding), rows
    # row_tokens wide; one program per token and sequence bucket
    mixed = dataclasses.replace(shapes, decode_programs=False)
    decode, decode_seq, blocks, _ = mixed._groups([None] * 4, cu, 16, 4)
    assert decode.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 16, 16, 16], [9, 10, 11, 12]]
    assert blocks.shape == (6, 8) and (blocks == 16).all()
    assert mixed.programs() == [(t, s, False, 4, 4) for t in (8, 16, 32) for s in (1, 2, 4) if s <= t]


@pytest.mark.slow  # ~30 s: an engine sized for 64K tokens
def test_page_tables_follow_the_live_context_not_the_engine_limits(model):
    """An engine sized for 64K tokens runs short requests with 2-page tables (the smallest bucket, 256 tokens of
    8-token pages is 32 pages here) and gives each prompt's solo decode on a 160-token cache; a long one widens the
    table."""
    from jax_sparse_kv.serving.model_runner import StepShapes, buckets

    shapes = StepShapes(buckets(8, 64), buckets(1, 8), rows_per_seq=1, table_width=8192, min_table_width=32)
    assert shapes.table_buckets == (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    one_width = StepShapes(buckets(8, 64), buckets(1, 8), 1, table_width=32, min_table_width=32)
    assert len(shapes.programs()) == 9 * len(one_width.programs())
    big = serving.Engine(model, num_pages=8192, page_size=8, **one_bucket(dict(max_seqs=4, max_tokens_per_step=32)))
    widths = []
    dispatch = big.runner.dispatch
    big.runner.dispatch = lambda inputs: (widths.append(inputs.page_indices.shape[1]), dispatch(inputs))[1]
    prompts = [[5, 17, 42, 8, 99, 3], list(range(1, 40)), [7] * 12]
    params = serving.SamplingParams(max_tokens=6, temperature=0.0)
    # the tokens of each prompt alone through make_step on the same (bf16) pools, a 160-token cache
    small = SoloGreedy(model, dtype=big.runner.cache.layout.dtype)
    assert [o.token_ids for o in big.generate(prompts, params)] == [small(p, 6) for p in prompts]
    assert big.shapes.table_width == 8192 and set(widths) == {32}
    widths.clear()
    long = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 300))  # 306 tokens: 39 pages of 8
    big.generate([long], params)
    assert max(widths) == 64


# ------------------------------------------------------------------ a restart reads its programs back

_RESTART = """
import json, sys, time
import jax
from support.serving_reference import fixture_model
from jax_sparse_kv import serving
import jax.numpy as jnp

events = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}
jax.monitoring.register_event_listener(lambda e, **kw: events.__setitem__(e, events[e] + 1) if e in events else None)
t0 = time.perf_counter()
eng = serving.Engine(fixture_model("flat"), num_pages=16, page_size=8, dtype=jnp.float32, max_seqs=2,
                     max_tokens_per_step=8, max_model_len=64, compilation_cache=sys.argv[1])
out = eng.generate([[5, 6, 7]], serving.SamplingParams(max_tokens=3))[0].token_ids
print(json.dumps({"tokens": out, "hits": events["/jax/compilation_cache/cache_hits"],
                  "misses": events["/jax/compilation_cache/cache_misses"], "seconds": time.perf_counter() - t0}))
"""


@pytest.mark.slow  # ~17 s: two engine processes, cold then warm compilation cache
def test_restarted_engine_reads_its_programs_from_the_compilation_cache(tmp_path):
    """Engine(compilation_cache=DIR): the first process writes every program it compiles there, a second (a
    restart) compiles none and gives the same tokens."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env["PYTHONPATH"] = os.path.dirname(__file__)
    runs = []
    for _ in range(2):
        cmd = [sys.executable, "-c", _RESTART, str(tmp_path / "xla")]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["misses"] > 0 and any((tmp_path / "xla").iterdir())
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"], runs
    assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == 3


def test_token_slices_equal_slices_of_the_whole_token_list():
    """Steps read a request's tokens by slice (no prompt + output list per step): the same tokens."""
    from jax_sparse_kv.serving.request import Request

    req = Request("r", list(range(10)), serving.SamplingParams(), 0, 0)
    req.output = [100, 101, 102]
    for a in range(16):
        for b in range(a, 16):
            assert req.token_slice(a, b) == req.tokens[a:b], (a, b)


def test_page_tables_and_prefix_hashes_are_built_once_per_page(monkeypatch):
    """Host work per step follows what the step adds: a request's int32 page array copies only appended pages
    (a new list starts over) and its prefix-hash chain hashes each full page once, equal to `page_hash`'s
    chain (and so to what `KVCacheManager.match` finds)."""
    from jax_sparse_kv.serving import request as request_module
    from jax_sparse_kv.serving.kv_cache_manager import page_hash
    from jax_sparse_kv.serving.request import Request

    req = Request("r", list(range(30)), serving.SamplingParams(), 0, 0)
    req.pages.extend([5, 6])
    assert req.page_array().tolist() == [5, 6]
    buffer = req.page_array().base
    req.pages.extend(range(7, 12))
    assert req.page_array().tolist() == [5, 6, 7, 8, 9, 10, 11] and req.page_array().base is buffer
    req.pages.extend(range(12, 60))  # past the buffer: grown, the old pages kept
    assert req.page_array().tolist() == [5, 6, *range(7, 60)]
    req.pages = [9]
    assert req.page_array().tolist() == [9]

    calls = []
    monkeypatch.setattr(request_module, "page_hash", lambda *a: calls.append(a) or page_hash(*a))
    expected, parent = [], None
    req.output = [200, 201, 202]
    for i in range(4):
        parent = page_hash(parent, req.tokens[i * 8 : (i + 1) * 8])
        expected.append(parent)
    assert req.prefix_hashes(8, 2)[:2] == expected[:2] and len(calls) == 2
    assert req.prefix_hashes(8, 4)[:4] == expected and len(calls) == 4  # the first two are not hashed again
    assert req.prefix_hashes(8, 3)[:3] == expected[:3] and len(calls) == 4
    kv = KVCacheManager(num_pages=8, page_size=8)
    pages = kv.allocate(3)
    for page, h in zip(pages, expected, strict=False):
        kv.register_hash(page, h)
    assert kv.match(req.tokens, max_pages=4) == (pages, expected[:3])
    assert kv.match_hashes(expected, 2) == pages[:2]


def test_output_kinds_cumulative_delta_and_final_only(engine, model):
    """The same greedy request three ways: deltas concatenate to the cumulative tokens (and logprobs); final_only
    gives one output; the prompt is the request's own list, not a copy per step."""
    prompt = random_prompts(np.random.default_rng(12), (7,), model.config.vocab_size)[0]
    outs = {}
    for kind in ("cumulative", "delta", "final_only"):
        rid = engine.add_request(prompt, serving.SamplingParams(max_tokens=5, logprobs=2, output_kind=kind))
        seen = []
        while engine.has_unfinished_requests():
            seen += [o for o in engine.step() if o.request_id == rid]
        outs[kind] = seen
    cumulative, delta, final = outs["cumulative"], outs["delta"], outs["final_only"]
    assert [t for o in delta for t in o.token_ids] == cumulative[-1].token_ids
    assert all(o.token_ids == o.new_token_ids for o in delta)
    assert [lp for o in delta for lp in o.logprobs] == cumulative[-1].logprobs
    assert len(final) == 1 and final[0].finished and final[0].token_ids == cumulative[-1].token_ids
    assert delta[0].prompt_token_ids is delta[-1].prompt_token_ids == prompt
    with pytest.raises(ValueError, match="output_kind"):
        serving.SamplingParams(output_kind="streaming").validate(20)
