"""Many hosts: `serving.Engine(model, mesh=)` over 2 processes x 2 CPU devices under `jax.distributed`.

Each process runs this file as a worker: gloo CPU collectives, `jax.distributed.initialize` with a
coordinator on a free local port, a ``("tp", "dp") = (2, 2)`` mesh with "tp" across the processes (each
holds half the heads and experts of the fixture, which has 2 KV heads and 4 experts),
`MiniMaxM3.from_pretrained(fixture, mesh=)` and an `Engine` on that mesh. Every process makes the same
engine calls (the engine is deterministic given them: seeds of requests that give none come from its
own seeded generator, in call order); the jitted step takes the host NumPy inputs as they are (JAX
treats them as replicated on every process). Checked: both processes get the single-process engine's
outputs, for `Engine.generate` on a few prompts and for a staggered script with an abort and a sampled
request.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.multihost_helpers import PROCESSES, init_process, run_workers
from support.serving_reference import one_bucket

pytestmark = pytest.mark.slow  # ~90 s: the engine over 2 worker processes x 2 CPU devices, and on one

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "m3" / "original_sharded"
PROMPTS = [list(range(3, 24)), [5, 9, 1], list(range(40, 77, 2))]


def make_engine(mesh):
    import jax.numpy as jnp

    from jax_sparse_kv import serving
    from jax_sparse_kv.nn import MiniMaxM3

    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh)
    return serving.Engine(
        model,
        num_pages=32,
        page_size=8,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=16)),
        max_model_len=96,
        mesh=mesh,
        seed=7,
    )


def scenario(engine) -> dict:
    """The same engine calls in every process: generate, then staggered requests with an abort."""
    from jax_sparse_kv.serving import SamplingParams

    out = {"generate": [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=8))]}
    first = engine.add_request([7, 8, 9, 10], SamplingParams(max_tokens=12))
    sampled = engine.add_request([11, 3, 5], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9))  # engine seed
    script = []
    for _ in range(2):
        script.append([(o.request_id, o.new_token_ids, o.finished) for o in engine.step()])
    engine.abort(first)
    engine.add_request(list(range(30, 45)), SamplingParams(max_tokens=6), request_id="late")
    while engine.has_unfinished_requests():
        script.append([(o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in engine.step()])
    script.append([(o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in engine.step()])
    out["script"] = script
    out["ids"] = [first, sampled]
    stats = engine.stats()
    out["left"] = [stats.running, stats.waiting, stats.num_pages - stats.free_pages - stats.cached_pages]
    return out


def worker(port: int, process_id: int, out: str) -> None:
    mesh = init_process(port, process_id)
    import jax

    engine = make_engine(mesh)
    k = engine.runner.cache.get_key_buffer(0)
    assert not k.is_fully_addressable and k.sharding.spec[1] == "tp"  # the cache spans both processes
    result = scenario(engine)
    result["process"] = jax.process_index()
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


def test_engine_over_two_processes_gives_the_single_process_outputs(tmp_path):
    outs = [tmp_path / f"process{i}.json" for i in range(PROCESSES)]
    # the single-process engine while the workers start (JSON round trip: lists, as the workers wrote)
    single = run_workers(__file__, outs, lambda: json.loads(json.dumps(scenario(make_engine(None)))))

    finished = {step[0]: step for steps in single["script"] for step in steps if step[2]}
    first, sampled = single["ids"]
    assert finished[first][3] == "abort" and finished["late"][3] == "length" and sampled in finished
    assert single["left"] == [0, 0, 0]  # nothing runs or waits, no page held
    for out in outs:
        result = json.loads(out.read_text())
        process = result.pop("process")
        assert result == single, f"process {process}"


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
