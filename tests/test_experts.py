"""The routed experts' three paths agree: the chosen experts gathered (decode), grouped ragged matmuls (prefill
on GPU/TPU) and every expert at once (prefill on CPU, small steps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jax_sparse_kv.nn import MiniMaxM3, demo_config
from jax_sparse_kv.nn import model as nn_model


@pytest.fixture(scope="module")
def experts():
    return MiniMaxM3(demo_config(), seed=0).layers[1].mlp.experts  # 8 experts, top 2, hidden 128


def routing(tokens: int, num_experts: int, seed: int = 0):
    """``x [tokens, 128]``, weights and ids ``[tokens, 2]``; every third token's second id is ``num_experts`` (no
    expert, weight 0: what expert parallelism gives for another device's experts)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, 128)), jnp.float32)
    ids = np.stack([rng.choice(num_experts, 2, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, 2)).astype(np.float32)
    ids[::3, 1], weights[::3, 1] = num_experts, 0.0
    return x, jnp.asarray(weights), jnp.asarray(ids)


def test_every_expert_equals_the_grouped_and_the_gathered_paths(experts):
    stacks = (experts.gate_up_proj[...], experts.down_proj[...])
    x, weights, ids = routing(12, 8)
    every = np.asarray(experts._every_expert(x, weights, ids, *stacks))
    assert np.abs(every).max() > 1e-3  # values to compare
    np.testing.assert_allclose(every, np.asarray(experts._grouped(x, weights, ids, *stacks)), rtol=1e-5, atol=1e-7)
    # 4 tokens x top-2 <= 8 experts: the decode path, which gathers the chosen experts' weights
    gathered = np.asarray(experts._routed(x[:4], weights[:4], ids[:4], *stacks))
    np.testing.assert_allclose(every[:4], gathered, rtol=1e-5, atol=1e-7)


def test_cpu_runs_every_expert_gpu_and_tpu_the_grouped_matmuls(experts, monkeypatch):
    """A prefill step's experts lowered for CPU run every expert: no sort of the token copies by expert (on CPU a
    ragged dot is a dense dot over every expert anyway, after transposing the stacks); for cuda and tpu they are
    grouped (ragged) matmuls; past the activation budget CPU takes the grouped path too."""
    x, weights, ids = routing(16, 8)
    fn = jax.jit(lambda x, w, i: experts(x, w, i))
    assert "stablehlo.sort" not in fn.lower(x, weights, ids).as_text()
    for platform in ("cuda", "tpu"):
        assert "ragged_dot" in export.export(fn, platforms=[platform])(x, weights, ids).mlir_module()
    monkeypatch.setattr(nn_model, "EVERY_EXPERT_ELEMENTS", 16 * 8 * 2 * 64 - 1)  # one element short
    big = jax.jit(lambda x, w, i: experts(x, w, i))
    assert "stablehlo.sort" in big.lower(x, weights, ids).as_text()
    np.testing.assert_allclose(np.asarray(big(x, weights, ids)), np.asarray(fn(x, weights, ids)), rtol=1e-5, atol=1e-7)
