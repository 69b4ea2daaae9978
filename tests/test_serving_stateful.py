"""A hypothesis state machine over the engine: random arrivals, lengths, budgets, page counts and aborts.

Invariants after every step: refcounts never negative, every page in exactly
one state (in use, cached, free), no page owned by two writers (a page held by
several requests is a full, hashed prefix page that none of them writes), and
when idle every page is free or cached. Every finished request equals the
model's greedy decode of its prompt alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.serving_reference import PAGE, fixture_model, one_bucket, solo_greedy

from jax_sparse_kv import serving
from jax_sparse_kv.serving.request import Status

pytestmark = pytest.mark.slow  # ~35 s: a hypothesis state machine over engines; test_serving checks cases

MODEL = fixture_model("flat")
SOLO = solo_greedy(MODEL)
ENGINES: dict[tuple, serving.Engine] = {}  # one engine (and its compiled programs) per configuration


def engine_for(num_pages: int, max_tokens_per_step: int, prefix_caching: bool) -> serving.Engine:
    key = (num_pages, max_tokens_per_step, prefix_caching)
    if key not in ENGINES:
        ENGINES[key] = serving.Engine(
            MODEL,
            num_pages=num_pages,
            page_size=PAGE,
            dtype=jnp.float32,
            **one_bucket(dict(max_seqs=3, max_tokens_per_step=max_tokens_per_step)),
            max_model_len=96,
            prefix_caching=prefix_caching,
        )
    return ENGINES[key]


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.sampled_from([6, 12]),
        budget=st.sampled_from([8, 16]),
        prefix_caching=st.booleans(),
    )
    def setup(self, num_pages, budget, prefix_caching):
        self.engine = engine_for(num_pages, budget, prefix_caching)
        assert not self.engine.has_unfinished_requests()
        self.live: dict[str, tuple[list[int], int]] = {}
        self.prefixes = [[int(t) for t in np.random.default_rng(i).integers(0, 128, 16)] for i in range(2)]

    @rule(
        length=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        shared=st.sampled_from([None, 0, 1]),
        seed=st.integers(0, 2**16),
    )
    def add(self, length, max_tokens, shared, seed):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 128, length)]
        if shared is not None:
            prompt = self.prefixes[shared] + prompt
        try:
            rid = self.engine.add_request(prompt, serving.SamplingParams(max_tokens=max_tokens))
        except ValueError as e:
            assert "could never fit" in str(e) or "max_model_len" in str(e)
            return
        self.live[rid] = (prompt, max_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort(rid)
        del self.live[rid]

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished and out.finish_reason != "abort":
                    prompt, max_tokens = self.live.pop(out.request_id)
                    assert out.token_ids == SOLO(prompt, max_tokens)

    @invariant()
    def books_balance(self):
        eng = self.engine
        eng.kv.check()
        owners: dict[int, list] = {}
        for req in eng.scheduler.running + list(eng.scheduler.waiting):
            assert req.status != Status.FINISHED
            for i, page in enumerate(req.pages):
                owners.setdefault(page, []).append((req, i))
        for page, held in owners.items():
            assert eng.kv.refcount[page] == len(held)
            if len(held) > 1:  # shared: a full page no holder writes again
                for req, i in held:
                    assert (i + 1) * PAGE <= req.num_computed
        if not eng.has_unfinished_requests():
            stats = eng.stats()
            assert stats.free_pages + stats.cached_pages == stats.num_pages

    def teardown(self):
        for rid in list(self.live):
            self.engine.abort(rid)
        self.engine.step()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=12, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)
)
