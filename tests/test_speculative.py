"""Speculative decoding: lossless greedy and sampled verification, dead rows never read, seeded reproducibility."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.serving_reference import PAGE, assert_idle, fixture_model, one_bucket, random_prompts, solo_greedy

from jax_sparse_kv import serving
from jax_sparse_kv.serving.request import Request
from jax_sparse_kv.serving.sampler import SamplingRows, verify_drafts
from jax_sparse_kv.serving.speculative import verify


@pytest.fixture(scope="module")
def model():
    return fixture_model("flat")


def fake_result(tokens, accept=None, residual=None):
    n = len(tokens)
    accept = np.zeros(n, bool) if accept is None else np.asarray(accept)
    residual = np.full(n, -1) if residual is None else np.asarray(residual)
    return types.SimpleNamespace(tokens=np.asarray(tokens), accept=accept, residual=residual)


def chi2(counts, p):
    expected = counts.sum() * p
    return (((counts - expected) ** 2) / expected).sum()


def test_rejection_sampling_on_the_device_emits_the_target_distribution():
    """Leviathan et al. with a deterministic draft, on the device (`verify_drafts`): whatever the draft, the
    emitted token (the draft if accepted, else the residual draw) is distributed as p; only [rows] arrays come
    back. 6000 rows = 6000 seeds in one call."""
    n = 6000
    p = np.array([0.1, 0.4, 0.2, 0.25, 0.05], np.float32)
    for draft in (1, 3, 4):
        rows = SamplingRows.from_numpy(
            np.ones(n), np.zeros(n), np.ones(n), np.zeros(n), np.arange(n), np.full(n, 7), draft=np.full(n, draft)
        )
        probs = jnp.tile(jnp.asarray(p), (n, 1))
        logprobs = jnp.log(probs)
        accept, residual, draft_lp, residual_lp = (np.asarray(x) for x in verify_drafts(probs, logprobs, rows))
        emitted = np.where(accept, draft, residual)
        assert chi2(np.bincount(emitted, minlength=5), p) < 18.5  # p = 0.001 at 4 degrees of freedom
        assert abs(accept.mean() - p[draft]) < 0.03 and not (residual[~accept] == draft).any()
        np.testing.assert_allclose(draft_lp, np.log(p[draft]), rtol=1e-6)
        np.testing.assert_allclose(residual_lp, np.log(p[residual]), rtol=1e-6)
    # a draft of probability 0 is never accepted; a row whose p holds only its draft always is (no residual)
    rows = SamplingRows.from_numpy(
        np.ones(2), np.zeros(2), np.ones(2), np.zeros(2), np.array([3, 4]), np.zeros(2), draft=np.array([2, 0])
    )
    probs = jnp.asarray([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    accept, residual, _, _ = verify_drafts(probs, jnp.log(probs), rows)
    assert accept.tolist() == [False, True] and int(residual[0]) in (0, 1) and int(residual[1]) == -1
    # the host takes the device's verdicts: the accepted prefix, then the residual (or the bonus token)
    req = Request("r", [0, 1, 2], serving.SamplingParams(temperature=1.0, max_tokens=10), seed=1, arrival=0)
    assert verify(req, (1, 3), fake_result([0, 0, 4], [True, False, False], [-1, 2, -1]), 0) == ([1, 2], 1, [0, 1])
    assert verify(req, (1, 3), fake_result([0, 0, 4], [True, True, False]), 0) == ([1, 3, 4], 2, [0, 1, 2])


def test_greedy_verification_accepts_matching_drafts_only():
    req = Request("r", [5, 6], serving.SamplingParams(max_tokens=9), seed=0, arrival=0)
    assert verify(req, (7, 8, 9), fake_result([7, 8, 4, 2]), 0) == ([7, 8, 4], 2, [0, 1, 2])
    assert verify(req, (7, 8), fake_result([7, 8, 3]), 0) == ([7, 8, 3], 2, [0, 1, 2])
    assert verify(req, (1,), fake_result([7, 8]), 0) == ([7], 0, [0])


def test_adaptive_ngram_drafts_follow_each_requests_acceptance():
    """``adaptive=True``: +2 drafts after a verification that accepts all, -1 after one that does not, within
    1..num_tokens, per request; ``adaptive=False`` keeps num_tokens; a finished request's count is dropped."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # prompt lookup always has 8 tokens to propose
    fixed = serving.NgramSpeculation(num_tokens=4)
    adaptive = serving.NgramSpeculation(num_tokens=4, adaptive=True)
    requests: dict = {}
    for spec in (fixed, adaptive):
        spec.attach(types.SimpleNamespace(max_model_len=1000))
    a, b = (Request(r, prompt, serving.SamplingParams(max_tokens=100), seed=0, arrival=0) for r in "ab")
    requests.update(a=a, b=b)
    counts = []
    for num_drafts, accepted in [(4, 1), (3, 0), (2, 0), (1, 0), (1, 1), (3, 3), (4, 2)]:
        fixed.observe(a, num_drafts, accepted)
        adaptive.observe(a, num_drafts, accepted)
        assert len(fixed.propose(a)) == 4
        counts.append(len(adaptive.propose(a)))
    assert counts == [3, 2, 1, 1, 3, 4, 3]
    assert len(adaptive.propose(b)) == 4  # its own count
    del requests["a"]
    adaptive.after_step(None, requests)
    assert "a" not in adaptive._counts and len(adaptive.propose(b)) == 4


def poison_dead_rows(engine: serving.Engine) -> int:
    """Writes NaN into every row of every pool past each running request's committed tokens, in its own pages."""
    cache = engine.runner.cache
    layout = cache.layout
    slots = []
    for req in engine.scheduler.running:
        for pos in range(req.num_computed, len(req.pages) * PAGE):
            slots.append(req.pages[pos // PAGE] * PAGE + pos % PAGE)
    if not slots:
        return 0
    loc = jnp.asarray(slots, jnp.int32)
    n = len(slots)
    nan = lambda heads, dim: jnp.full((n, heads, dim), jnp.nan, jnp.float32)  # noqa: E731
    main = nan(layout.head_num, layout.head_dim)
    index = nan(1, layout.index_head_dim)
    for layer in layout.dense_layer_ids:
        cache = cache.set_kv_buffer(layer, loc, main, main)
    for layer in layout.sparse_layer_ids:
        iv = None if layer in layout.k_only_layer_ids else index
        cache = cache.set_fused_kv_index_buffer(layer, loc, main, main, index, iv)
    engine.runner.cache = cache
    return n


@pytest.mark.slow  # engines of its own per case
@pytest.mark.parametrize(
    "speculative",
    [None, serving.NgramSpeculation(num_tokens=3), serving.NgramSpeculation(num_tokens=3, adaptive=True)],
    ids=["plain", "ngram", "adaptive"],
)
def test_rows_past_the_committed_length_never_reach_a_result(model, speculative):
    """NaN in every dead row (rejected drafts, the rest of a page) of main K/V and index K after each step: every
    output is still the prompt's solo greedy decode (n-gram drafts: greedy speculation is lossless), and the page
    books balance after."""
    solo = solo_greedy(model)
    eng = serving.Engine(
        model,
        num_pages=48,
        page_size=PAGE,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=16)),
        max_model_len=160,
        speculative=speculative,
    )
    rng = np.random.default_rng(20)
    base = random_prompts(rng, (5, 7), model.config.vocab_size)
    prompts = [b * 3 for b in base] + random_prompts(rng, (13, 26), model.config.vocab_size)
    ids = [eng.add_request(p, serving.SamplingParams(max_tokens=12)) for p in prompts]
    done, poisoned = {}, 0
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        poisoned += poison_dead_rows(eng)
    assert poisoned > 0
    for prompt, rid in zip(prompts, ids, strict=True):
        assert done[rid] == solo(prompt, 12)
    if speculative is not None:
        stats = eng.stats()
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0  # some drafts were rejected
        assert stats.mean_acceptance_length > 1.0
    assert_idle(eng)


@pytest.mark.slow  # engines of its own
def test_sampled_speculation_is_seeded(model):
    params = serving.SamplingParams(max_tokens=14, temperature=0.9, seed=77)
    prompt = random_prompts(np.random.default_rng(21), (6,), model.config.vocab_size)[0] * 3
    runs = []
    for others in (0, 3):
        eng = serving.Engine(
            model,
            num_pages=48,
            page_size=PAGE,
            dtype=jnp.float32,
            **one_bucket(dict(max_seqs=4, max_tokens_per_step=16 if others else 8)),
            max_model_len=160,
            speculative=serving.NgramSpeculation(num_tokens=3),
        )
        crowd = random_prompts(np.random.default_rng(22), (9, 30, 4)[:others], model.config.vocab_size)
        outs = eng.generate(crowd + [prompt], [serving.SamplingParams(max_tokens=10)] * others + [params])
        runs.append(outs[-1].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 14


@pytest.mark.slow  # engines with draft models
@pytest.mark.parametrize("draft", ["small", "itself"])
def test_draft_model_speculation_is_lossless(model, draft):
    from jax_sparse_kv.nn import MiniMaxM3, tiny_config

    draft_model = model if draft == "itself" else MiniMaxM3(tiny_config("ds", vocab_size=128), seed=3)
    solo = solo_greedy(model)
    spec = serving.DraftModelSpeculation(draft_model, num_tokens=3)
    eng = serving.Engine(
        model,
        num_pages=40,
        page_size=PAGE,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=3, max_tokens_per_step=16)),
        max_model_len=160,
        speculative=spec,
    )
    calls = []  # the draft model's calls: catch-up steps (C), drafting calls (X); target steps with drafts (T)
    dispatch, drafting, target = spec.runner.dispatch, spec.runner.dispatch_drafts, eng.runner.dispatch
    spec.runner.dispatch = lambda inputs: calls.append("C") or dispatch(inputs)
    spec.runner.dispatch_drafts = lambda *args: calls.append("X") or drafting(*args)
    eng.runner.dispatch = lambda inputs: (
        calls.append("T") if (inputs.sampling.draft >= 0).any() else None,
        target(inputs),
    )[1]
    prompts = random_prompts(np.random.default_rng(23), (4, 19, 30, 9), model.config.vocab_size)
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=11))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == solo(prompt, 11)
    # one drafting call before each target step with drafts (every draft of every request in it), after the
    # catch-up steps of prompts longer than the step budget (16 tokens): a 30-token prompt needs one
    trace = "".join(calls)
    assert re.fullmatch(r"(C*XT)+", trace), trace
    assert "CX" in trace and trace.count("X") == trace.count("T") >= 3
    stats = eng.stats()
    assert stats.spec_draft_tokens > 0
    if draft == "itself":  # the model drafting for itself is always right
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert stats.mean_acceptance_length > 3.0
    assert_idle(eng)


def test_draft_model_must_share_the_vocabulary(model):
    from jax_sparse_kv.nn import MiniMaxM3, tiny_config

    with pytest.raises(ValueError, match="draft_model vocab_size=256 differs from the model's 128"):
        serving.Engine(
            model,
            num_pages=8,
            page_size=PAGE,
            dtype=jnp.float32,
            max_model_len=64,
            speculative=serving.DraftModelSpeculation(MiniMaxM3(tiny_config("d"), seed=0), 2),
        )


SPEC_ENGINES: dict[tuple, serving.Engine] = {}


def spec_engine(spelling: str, k: int, decode_programs: bool = False) -> serving.Engine:
    """An n-gram engine of `k` drafts on a fixture, one per arguments; `decode_programs` as `Engine`'s (the
    one-bucket default: verifications in the mixed program)."""
    key = (spelling, k, decode_programs)
    if key not in SPEC_ENGINES:
        SPEC_ENGINES[key] = serving.Engine(
            fixture_model(spelling),
            num_pages=48,
            page_size=PAGE,
            dtype=jnp.float32,
            **one_bucket(dict(max_seqs=3, max_tokens_per_step=16, decode_programs=decode_programs)),
            max_model_len=160,
            speculative=serving.NgramSpeculation(num_tokens=k),
        )
    return SPEC_ENGINES[key]


# One checkpoint spelling (test_m3_fixtures checks that every spelling loads the same weights) and two draft
# counts: each (spelling, k) engine compiles its own program.
@pytest.mark.slow  # a property test over 6 engines
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    k=st.sampled_from([1, 4]),
    # (prompt length, times it repeats, tokens to generate, seed) per request
    batch=st.lists(
        st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 14), st.integers(0, 999)), min_size=1, max_size=4
    ),
)
def test_greedy_speculation_equals_plain_decoding(k, batch):
    """Property: over random prompts (some quoting themselves), k and batch mixes."""
    eng = spec_engine("flat", k)
    solo = solo_greedy(fixture_model("flat"))
    prompts, steps = [], []
    for length, repeats, n, seed in batch:
        base = random_prompts(np.random.default_rng(seed), (length,), 128)[0]
        prompts.append(base * repeats)
        steps.append(n)
    outs = eng.generate(prompts, [serving.SamplingParams(max_tokens=n) for n in steps])
    for prompt, n, out in zip(prompts, steps, outs, strict=True):
        assert out.token_ids == solo(prompt, n)
    assert not eng.has_unfinished_requests()


@pytest.mark.slow  # 15 s (decode programs and a second engine); speculation's tokens are plain decoding's above
def test_verification_tokens_attend_as_decode_rows_on_cpu(model, monkeypatch):
    """On CPU a verification's ``1 + k`` tokens are one decode row (each query through the cache up to its own
    position), not a query block: a step where every sequence verifies has no query blocks, each row holds
    all of one sequence's tokens and the rows cover every token; the tokens are plain decoding's. Elsewhere
    the query-block kernels take them (``row_tokens`` stays 1). (The tests' other engines run every step in the
    mixed program, ``decode_programs=False``: rows padded to ``row_tokens`` beside empty blocks.)"""
    eng = spec_engine("flat", 3, decode_programs=True)
    assert eng.runner.platform == "cpu" and eng.shapes.row_tokens == 4
    seen = []
    dispatch = eng.runner.dispatch
    monkeypatch.setattr(eng.runner, "dispatch", lambda inputs: (seen.append(inputs), dispatch(inputs))[1])
    prompts = [[3, 9, 27, 81] * 4, [5, 6, 7] * 5]
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=12))
    solo = solo_greedy(model)
    assert [o.token_ids for o in outs] == [solo(p, 12) for p in prompts]
    verifying = [i for i in seen if (np.asarray(i.sampling.draft) >= 0).any() and np.diff(i.cu_q_lens).max() <= 4]
    assert verifying
    for inputs in verifying:
        real = int(inputs.cu_q_lens[-1])
        assert inputs.blocks.shape[0] == 0
        assert sorted(inputs.decode[inputs.decode < len(inputs.tokens)].tolist()) == list(range(real))
        for row, seq in zip(inputs.decode, inputs.decode_seq, strict=True):  # a row: all of one sequence's tokens
            if (row < len(inputs.tokens)).any():
                assert row[row < len(inputs.tokens)].tolist() == list(range(*inputs.cu_q_lens[seq : seq + 2]))
    monkeypatch.setattr(type(eng.runner), "platform", property(lambda self: "gpu"))
    gpu = serving.Engine(
        model,
        num_pages=48,
        page_size=PAGE,
        **one_bucket(dict(max_seqs=3, max_tokens_per_step=16)),
        speculative=serving.NgramSpeculation(num_tokens=3),
    )
    assert gpu.shapes.row_tokens == 1


def test_an_all_greedy_verification_computes_no_distribution():
    """With every row greedy, the verification step returns the argmax and no verdicts (the host checks greedy
    drafts against the argmax); logprobs only when asked. A mixed step still verifies on the device."""
    from jax_sparse_kv.serving.sampler import sample

    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 11)), jnp.float32)
    z = np.zeros(4)
    greedy = SamplingRows.from_numpy(z, z, np.ones(4), z, np.arange(4), z, draft=np.array([2, 5, -1, 0]))
    tokens, chosen, top_ids, top_lp, accept, residual, draft_lp, residual_lp = (
        np.asarray(x) for x in sample(logits, greedy, 2, return_probs=True)
    )
    assert tokens.tolist() == np.argmax(np.asarray(logits), axis=-1).tolist()
    assert not accept.any() and (residual == -1).all() and not draft_lp.any() and not chosen.any()
    asked = SamplingRows.from_numpy(
        z, z, np.ones(4), z, np.arange(4), z, logprobs=np.array([2, -1, -1, -1]), draft=np.array([2, 5, -1, 0])
    )
    _, chosen, top_ids, top_lp, *_ = (np.asarray(x) for x in sample(logits, asked, 2, return_probs=True))
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(chosen, logprobs.max(axis=-1), rtol=1e-6)
    assert top_ids[0].tolist() == np.argsort(-logprobs[0])[:2].tolist()
    mixed = SamplingRows.from_numpy(
        np.array([0.0, 1.0, 0.0, 0.0]), z, np.ones(4), z, np.arange(4), z, draft=np.array([2, 5, -1, 0])
    )
    _, chosen, _, _, accept, residual, draft_lp, _ = (
        np.asarray(x) for x in sample(logits, mixed, 2, return_probs=True)
    )
    np.testing.assert_allclose(draft_lp[1], logprobs[1, 5], rtol=1e-6)  # the sampled row's draft, verified
    assert accept[1] or residual[1] not in (-1, 5)
