"""Properties of the indexer's block selection, for random scores and positions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sparse_kv import ops


@pytest.mark.slow  # 5-10 s: a hypothesis sweep over selections
@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    topk=st.integers(2, 8),
    init_blocks=st.integers(0, 1),
    local_blocks=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_blocks_properties(num_blocks, block_size, topk, init_blocks, local_blocks, seed):
    topk = max(topk, init_blocks + local_blocks)
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(1, 6, 1, num_blocks)).astype(np.float32)
    positions = rng.integers(-1, num_blocks * block_size, size=(1, 6)).astype(np.int32)
    sel = np.asarray(
        ops.select_blocks(jnp.asarray(scores), jnp.asarray(positions), block_size, topk, init_blocks, local_blocks)
    )
    assert sel.shape == (1, 6, 1, topk)
    for i, p in enumerate(positions[0]):
        chosen = [int(b) for b in sel[0, i, 0] if b >= 0]
        if p < 0:
            assert chosen == []
            continue
        current = p // block_size
        candidates = set(range(current + 1))
        forced = {b for b in candidates if b < init_blocks or b > current - local_blocks}
        assert len(chosen) == len(set(chosen)) == min(topk, current + 1)  # distinct, as many as possible
        assert set(chosen) <= candidates  # never a future block
        assert forced <= set(chosen)  # init and local blocks always in
        # every unforced choice scores at least as high as every candidate left out
        left_out = candidates - set(chosen)
        for b in set(chosen) - forced:
            assert all(scores[0, i, 0, b] >= scores[0, i, 0, o] for o in left_out)
