"""Speculation methods run without an `Engine`: a hand-built `SpeculationContext` at attach, the live requests
and the step's aux states as arguments of the per-step hooks (calls go engine -> speculation only)."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_kv import serving
from jax_sparse_kv.serving.model_runner import StepShapes
from jax_sparse_kv.serving.request import Request
from jax_sparse_kv.serving.scheduler import ScheduledSeq, StepPlan
from jax_sparse_kv.serving.speculative import Eagle3Speculation, NgramSpeculation, SpeculationContext

PAGE = 16


def context(**overrides) -> SpeculationContext:
    facts = dict(
        max_model_len=30,
        max_seqs=4,
        max_tokens_per_step=64,
        page_size=PAGE,
        num_slots=8 * PAGE,
        dtype=jnp.float32,
        vocab_size=100,
        hidden_size=8,
        shapes=StepShapes(token_buckets=(8, 16, 32, 64), seq_buckets=(1, 2, 4), rows_per_seq=5, table_width=2),
    )
    return SpeculationContext(**{**facts, **overrides})


def request(rid: str, prompt: list[int], max_tokens: int = 100) -> Request:
    return Request(rid, prompt, serving.SamplingParams(max_tokens=max_tokens), seed=0, arrival=0)


def test_the_context_is_frozen_and_exported():
    ctx = context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.max_model_len = 10  # type: ignore[misc]
    assert serving.SpeculationContext is SpeculationContext
    assert ctx.mesh is None and ctx.aux_layer_ids == () and ctx.kv_scale == 1.0


def test_ngram_speculation_proposes_from_a_context_and_fake_requests():
    """Prompt lookup through `propose`, cut by the context's ``max_model_len`` and the request's ``max_tokens``;
    `after_step` forgets requests missing from the live ids it is handed, and keeps the others'."""
    spec = NgramSpeculation(num_tokens=4)
    spec.attach(context())
    assert not hasattr(spec, "engine")
    quoting = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # 24 tokens: the suffix 6 7 8 was followed by 1 2 3 4
    a = request("a", quoting)
    assert spec.propose(a) == [1, 2, 3, 4]
    a.output.append(1)  # 25 tokens: room for 30 - 25 - 1 = 4 drafts
    assert spec.propose(a) == [2, 3, 4, 5]
    a.output += [2, 3]  # 27 tokens: 2 drafts fit below max_model_len
    assert spec.propose(a) == [4, 5]
    short = request("b", quoting, max_tokens=2)  # its own budget: 1 draft (the bonus token is the other)
    assert spec.propose(short) == [1]
    assert spec.propose(request("c", [9, 10, 11])) == []  # nothing to quote
    assert set(spec._indexes) == {"a", "b", "c"}
    spec.after_step(StepPlan(seqs=[ScheduledSeq(a, 26, 1)], preempted=[]), live={"a"})
    assert set(spec._indexes) == {"a"}
    assert spec.propose(a) == [4, 5]


def test_adaptive_counts_follow_observations_and_end_with_the_request():
    spec = NgramSpeculation(num_tokens=4, adaptive=True)
    spec.attach(context(max_model_len=1000))
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8] * 3)
    spec.observe(a, 4, 1)
    assert len(spec.propose(a)) == 3
    spec.after_step(StepPlan(seqs=[], preempted=[]), live=())
    assert spec._counts == {} and spec._indexes == {}
    assert len(spec.propose(a)) == 4  # a request seen anew starts at num_tokens


def test_eagle3_attach_checks_the_head_against_the_context():
    """An EAGLE3 head is checked against the context's facts and gets pools as long as the target's; its
    `after_step` with no aux states only drops the state of requests that ended."""
    head = types.SimpleNamespace(
        config=types.SimpleNamespace(hidden_size=8, vocab_size=100, num_key_value_heads=2, head_dim=4),
        aux_layer_ids=(0, 1),
        draft=lambda *args, **kwargs: None,
        params=None,
    )
    with pytest.raises(ValueError, match="does not fit"):
        Eagle3Speculation(head).attach(context(hidden_size=16))
    with pytest.raises(ValueError, match="aux hidden states"):
        Eagle3Speculation(head).attach(context())
    spec = Eagle3Speculation(head, num_tokens=2)
    spec.attach(context(aux_layer_ids=(0, 1)))
    assert spec.k_pool.shape == (9 * PAGE, 2, 4) and spec.k_pool.dtype == jnp.float32  # 8 pages + the padding page
    spec._drafts = {"a": [5, 6], "b": [7]}
    a = request("a", [1, 2, 3], max_tokens=10)
    assert spec.propose(a) == [5, 6]
    spec.after_step(StepPlan(seqs=[], preempted=[]), live={"a"}, aux=None)
    assert spec._drafts == {"a": [5, 6]}
    assert np.asarray(spec.v_pool).sum() == 0
