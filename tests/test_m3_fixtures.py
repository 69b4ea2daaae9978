"""MiniMax-M3 against transformers' recorded outputs, without torch.

tests/fixtures/m3/ holds one tiny random model in three checkpoint spellings and
what transformers computed with it (tests/fixtures/make_m3_fixtures.py
regenerates them). Every spelling must load into the same model and reproduce
the reference: prefill logits and 10 greedy steps within 1e-4 of the largest
logit, identical tokens, identical indexer selections.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.m3_reference import rel, run_ours, same_block_sets

from jax_sparse_kv.nn import MiniMaxM3
from jax_sparse_kv.nn.params import hf_params

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "m3")
SPELLINGS = ("flat", "original_sharded", "vl")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(os.path.join(FIXTURES, "reference.npz")))


@pytest.fixture(scope="module")
def models():
    return {s: MiniMaxM3.from_pretrained(os.path.join(FIXTURES, s)) for s in SPELLINGS}


def test_every_spelling_loads_the_same_weights(models):
    names = {s: hf_params(m) for s, m in models.items()}
    assert all(n.keys() == names["flat"].keys() for n in names.values())
    for key, var in names["flat"].items():
        for s in SPELLINGS[1:]:
            np.testing.assert_array_equal(np.asarray(names[s][key][...]), np.asarray(var[...]), err_msg=f"{s}: {key}")


@pytest.mark.parametrize(
    "spelling",
    # 7 s and 16 s; the weights of every spelling are the same (above), test_m3_reference decodes against transformers
    [pytest.param(s, marks=pytest.mark.slow) for s in SPELLINGS[:2]],
)
def test_fixture_decode_matches_transformers(spelling, models, reference):
    model = models[spelling]
    steps = reference["steps"].shape[0]
    prefill, step_logits, tokens, selections = run_ours(model, reference["prompts"], steps, int(reference["page_size"]))
    assert rel(prefill, reference["prefill"]) <= 1e-4
    np.testing.assert_array_equal(tokens, reference["tokens"])
    assert rel(step_logits, reference["steps"]) <= 1e-4
    for layer in model.config.sparse_layer_ids:
        for i in range(steps + 1):
            assert same_block_sets(selections[layer][i], reference[f"sel_{layer}_{i}"]), (layer, i)


@pytest.mark.slow  # 10-13 s: the fixture decode tests that stay check the same model
def test_fixture_cache_free_pass_matches_transformers(models, reference):
    prompts = reference["prompts"]
    positions = np.broadcast_to(np.arange(prompts.shape[1]), prompts.shape)
    with jax.default_matmul_precision("highest"):
        logits, _ = models["vl"](jnp.asarray(prompts), jnp.asarray(positions))
    assert rel(logits, reference["prefill"]) <= 1e-4
