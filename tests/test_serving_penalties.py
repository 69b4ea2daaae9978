"""Presence, frequency and repetition penalties (vLLM's semantics) in the engine, against NumPy.

The reference recomputes each step's logits with the model's cache-free pass over the request's own tokens and
applies the penalties in float64: repetition over the prompt's and the output's tokens (a positive logit
divided, a negative one multiplied), then ``frequency * count + presence * (count > 0)`` over the output's.
The engine keeps the counts on the device; its choices must be the reference's argmax at every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.serving_reference import fixture_model, make_engine, random_prompts, solo_greedy

from jax_sparse_kv import serving
from jax_sparse_kv.serving.sampler import penalty_state_bytes


@pytest.fixture(scope="module")
def model():
    return fixture_model("flat")


def penalized(logits: np.ndarray, prompt, output, presence=0.0, frequency=0.0, repetition=1.0) -> np.ndarray:
    out = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(out)).astype(np.float64)
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, np.int64), minlength=len(out)) > 0)
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    return out - frequency * counts - presence * (counts > 0)


WIDTH = 64  # every reference pass padded to one width: one compiled program


@functools.cache
def _forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, tokens, positions: nnx.merge(graphdef, state)(tokens, positions)[0]), state


def last_logits(model, tokens) -> np.ndarray:
    """The model's cache-free logits after `tokens` (padded to `WIDTH`, positions -1 on the padding)."""
    fn, state = _forward(model)
    padded = np.zeros((1, WIDTH), np.int32)
    padded[0, : len(tokens)] = tokens
    positions = np.where(np.arange(WIDTH) < len(tokens), np.arange(WIDTH), -1)[None]
    return np.asarray(fn(state, jnp.asarray(padded), jnp.asarray(positions))[0, len(tokens) - 1])


def check_greedy(model, prompt, output, **penalties) -> None:
    """Each generated token is the argmax of the reference's penalized logits (to a float32 rounding)."""
    for i, token in enumerate(output):
        ref = penalized(last_logits(model, list(prompt) + list(output[:i])), prompt, output[:i], **penalties)
        assert ref[token] >= ref.max() - 1e-4, (i, token, int(np.argmax(ref)), ref[token], ref.max())


CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(repetition_penalty=1.8),
    dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3),
]


def test_greedy_penalties_follow_the_numpy_reference(model):
    """Each penalty alone and all three together, two requests each, in one batch beside an unpenalized request."""
    engine = make_engine(model)
    solo = solo_greedy(model)
    prompts = random_prompts(np.random.default_rng(3), (9, 20) * len(CASES), model.config.vocab_size)
    plain = [list(range(5, 5 + 12))]  # an unpenalized request beside them: its tokens are its solo decode
    params = [serving.SamplingParams(max_tokens=14, **case) for case in CASES for _ in range(2)]
    outs = engine.generate(list(prompts) + plain, params + [serving.SamplingParams(max_tokens=14)])
    for i, (prompt, out) in enumerate(zip(prompts, outs[:-1], strict=True)):
        check_greedy(model, prompt, out.token_ids, **{k.split("_")[0]: v for k, v in CASES[i // 2].items()})
    assert outs[-1].token_ids == solo(plain[0], 14)
    # each case's penalties changed something (else the check above could not fail)
    for i in range(len(CASES)):
        assert any(outs[j].token_ids != solo(prompts[j], 14) for j in (2 * i, 2 * i + 1)), CASES[i]
    engine.step()
    assert engine.runner._slots == {}  # finished requests gave their count rows back (at the next schedule)


def test_penalties_take_no_program_of_their_own(model):
    """Every step takes the count table (the sampler applies the penalties to every row, neutral where a row has
    none): after `warmup`, the first request with penalties compiles nothing, and its tokens are still the
    reference's."""
    engine = make_engine(model)
    counts, prompt_ids = engine.runner._penalty_state  # allocated with the engine: what `plan` counts per device
    assert counts.nbytes + prompt_ids.nbytes == penalty_state_bytes(
        engine.runner.penalty_slots, model.config.vocab_size
    )
    programs = engine.warmup(progress=False)
    assert engine.stats().compilations == programs == 1
    prompt = list(range(40, 52))
    (out,) = engine.generate([prompt], serving.SamplingParams(max_tokens=8, frequency_penalty=2.0))
    assert engine.stats().compilations == programs
    check_greedy(model, prompt, out.token_ids, frequency=2.0)
    assert out.token_ids != solo_greedy(model)(prompt, 8)  # the penalty changed something


@pytest.mark.slow  # ~30 s: engines of its own; the default run checks each penalty against a reference
def test_seeded_sampling_with_penalties_does_not_depend_on_the_batch(model):
    params = serving.SamplingParams(
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=42,
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={3: 2.0},
    )
    prompt = list(range(20, 31))
    (alone,) = make_engine(model).generate([prompt], params)
    others = random_prompts(np.random.default_rng(8), (7, 13, 25), model.config.vocab_size)
    batch = make_engine(model, max_tokens_per_step=8).generate(
        [list(p) for p in others[:2]] + [prompt] + [list(others[2])],
        [serving.SamplingParams(max_tokens=6, repetition_penalty=1.5)] * 2 + [params, serving.SamplingParams()],
    )
    assert batch[2].token_ids == alone.token_ids


@pytest.mark.slow  # ~30 s: an engine under preemption; the default run checks each penalty against a reference
def test_preemption_keeps_the_counts(model):
    """Too few pages for all requests: some are preempted and recomputed; penalized tokens stay the reference's."""
    prompts = random_prompts(np.random.default_rng(5), (30, 31, 29, 33), model.config.vocab_size)
    params = serving.SamplingParams(max_tokens=20, frequency_penalty=0.9, repetition_penalty=1.4)
    engine = make_engine(model, num_pages=12, max_seqs=2)  # more penalized requests than count rows, preempted
    outs = engine.generate([list(p) for p in prompts], params)
    engine.step()  # (rows are given back when the engine next schedules)
    assert engine.stats().preemptions > 0 and engine.runner._slots == {}
    full = make_engine(model).generate([list(p) for p in prompts], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    check_greedy(model, prompts[0], outs[0].token_ids, frequency=0.9, repetition=1.4)


def test_bad_penalties_are_named(model):
    engine = make_engine(model)
    for bad, match in [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),  # vLLM's bound (any value > 0)
        (dict(repetition_penalty=float("nan")), r"repetition_penalty must be > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request([1, 2, 3], serving.SamplingParams(**bad))
