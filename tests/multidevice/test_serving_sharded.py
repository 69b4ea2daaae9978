"""`serving.Engine(..., mesh=)`: the engine over a sharded model and cache gives the unsharded engine's tokens.

Both mesh kinds (`jax.make_mesh`: Explicit axes; `jax.sharding.Mesh`: Auto axes); heads and experts split
over 2 devices (the fixture model has 2 KV heads and 4 experts).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "m3", "flat")
PROMPTS = [list(range(3, 24)), [5, 9, 1], list(range(40, 77, 2))]


def engine(mesh=None, **kw):
    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh)
    return serving.Engine(model, num_pages=32, page_size=8, dtype=jnp.bfloat16, max_seqs=4, max_tokens_per_step=16,
                          max_model_len=96, mesh=mesh, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def unsharded():
    return [o.token_ids for o in engine().generate(PROMPTS, serving.SamplingParams(max_tokens=8))]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_engine_gives_the_unsharded_tokens(kind, unsharded):
    devices = jax.devices()[:2]
    mesh = jax.make_mesh((2,), ("tp",), devices=devices) if kind == "explicit" else Mesh(np.array(devices), ("tp",))
    assert (mesh.axis_types[0] == AxisType.Explicit) == (kind == "explicit")
    eng = engine(mesh)
    outs = eng.generate(PROMPTS, serving.SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outs] == unsharded
    k = eng.runner.cache.get_key_buffer(0)
    assert len(k.sharding.device_set) == 2 and k.addressable_shards[0].data.shape[1] == 1  # one KV head per device
    assert eng.stats().compilations <= len(eng.shapes.programs())
