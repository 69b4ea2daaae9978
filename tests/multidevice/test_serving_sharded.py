"""`serving.Engine(..., mesh=)`: the engine over a sharded model and cache gives the unsharded engine's tokens.

Both mesh kinds (`jax.make_mesh`: Explicit axes; `jax.sharding.Mesh`: Auto axes), one through each engine test
(each engine compiles its whole step; test_mesh_kinds.py runs the model's step on both kinds of every mesh);
heads and experts split over 2 devices (the fixture model has 2 KV heads and 4 experts).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from support.serving_reference import one_bucket

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "m3", "flat")
PROMPTS = [list(range(3, 24)), [5, 9, 1], list(range(40, 77, 2))]


def engine(mesh=None, **kw):
    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh)
    return serving.Engine(
        model,
        num_pages=32,
        page_size=8,
        dtype=jnp.bfloat16,
        max_model_len=96,
        mesh=mesh,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=16, **kw)),
    )


@pytest.fixture(scope="module")
def unsharded():
    return [o.token_ids for o in engine().generate(PROMPTS, serving.SamplingParams(max_tokens=8))]


@pytest.mark.parametrize("kind", ["explicit"])
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


@pytest.mark.parametrize("kind", ["auto"])
def test_experts_over_every_device_heads_on_tp(kind, unsharded):
    """A ("ep", "tp") mesh of 2 x 2: 2 KV heads split on tp (replicated over ep), the 4 routed experts over all
    4 devices (one each); the engine gives the unsharded tokens."""
    devices = jax.devices()[:4]
    if kind == "explicit":
        mesh = jax.make_mesh((2, 2), ("ep", "tp"), devices=devices)
    else:
        mesh = Mesh(np.array(devices).reshape(2, 2), ("ep", "tp"))
    eng = engine(mesh)
    assert [o.token_ids for o in eng.generate(PROMPTS, serving.SamplingParams(max_tokens=8))] == unsharded
    experts = eng.model.layers[1].mlp.experts
    assert experts.expert_parallel[1] == ("ep", "tp")
    gate_up = experts.gate_up_proj[...]
    assert len(gate_up.sharding.device_set) == 4 and gate_up.addressable_shards[0].data.shape[0] == 1
    k = eng.runner.cache.get_key_buffer(0)
    assert k.addressable_shards[0].data.shape[1] == 1  # one KV head per device, replicated over "ep"


def test_a_moe_layer_adds_expert_parts_with_a_psum_and_gathers_no_expert():
    """8 devices, 4 KV heads, 8 experts: in the compiled prefill and decode programs no collective moves an
    expert's weights (no all-gather as large as one expert); the experts' parts meet in all-reduces."""
    import re

    from flax import nnx

    from jax_sparse_kv.nn import demo_config
    from jax_sparse_kv.nn.parallel import shard_model

    config = demo_config()
    mesh = jax.make_mesh((2, 4), ("ep", "tp"))
    model = shard_model(MiniMaxM3(config, seed=0), mesh)
    one_expert = 2 * config.intermediate_size * config.hidden_size
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, t, p: nnx.merge(graphdef, state)(t, p)[0])
    for tokens in (1, 48):
        hlo = run.lower(state, jnp.zeros((1, tokens), jnp.int32), jnp.arange(tokens)[None]).compile().as_text()
        gathered = [
            int(np.prod([int(d) for d in dims.split(",") if d]))
            for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
        ]
        assert all(n < one_expert for n in gathered), (tokens, gathered)
        assert re.search(r" all-reduce\(", hlo)
