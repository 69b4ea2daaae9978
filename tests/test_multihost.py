"""Many hosts: 2 processes x 2 CPU devices under `jax.distributed`, one mesh over all 4 devices.

Each process runs this file as a worker (the same script everywhere, as on a TPU pod slice or several
GPU hosts; see BUILD.md): gloo CPU collectives, `jax.distributed.initialize` with a coordinator on a free
local port, `MiniMaxM3.from_pretrained(fixture, mesh=)`, `SparseKVCache.zeros(mesh=)`,
`make_step(mesh=)`, prefill + greedy decode. Checked: every process gets the single-process tokens (and
transformers' tokens of the fixture; the fixture quantized to MXFP8 and kept in fp8 gives the single-process
resident tokens with its experts and their scales over both processes), and each process reads from the safetensors files exactly the bytes
of its own shards plus the replicated tensors, about half of the sharded bytes less than the checkpoint.

The fixture has 2 KV heads and 4 experts, so the mesh is ``("tp", "dp") = (2, 2)`` with "tp" across the
processes: each process holds one half of the heads (on both its devices) and the experts split over all four
devices (experts over every mesh axis), so each process holds one half of the experts, one per device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from support.multihost_helpers import PROCESSES, init_process, run_workers

pytestmark = pytest.mark.slow  # ~30 s: 2 worker processes x 2 CPU devices under jax.distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "m3" / "original_sharded"
REFERENCE = FIXTURE.parent / "reference.npz"


def generate(model, mesh, prompts, steps, page_size):
    import jax.numpy as jnp

    import jax_sparse_kv as jsk
    from jax_sparse_kv.nn import DecodeSession, make_step

    batch, length = prompts.shape
    pages = -(-(length + steps) // page_size)
    layout = model.config.layout(num_slots=(batch * pages + 1) * page_size, page_size=page_size, dtype=jnp.float32)
    table = jnp.asarray(np.arange(1, batch * pages + 1).reshape(batch, pages), jnp.int32)
    session = DecodeSession(make_step(model, mesh=mesh), jsk.SparseKVCache.zeros(layout, mesh=mesh), table)
    tokens, _ = session.generate([list(p) for p in prompts], steps)
    return tokens, session


def worker(port: int, process_id: int, out: str) -> None:
    mesh = init_process(port, process_id)
    import jax
    from jax.sharding import PartitionSpec

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn.parallel import model_partition_specs
    from jax_sparse_kv.nn.weights import _headers, checkpoint_pieces

    read: dict[str, int] = {}

    def on_tensor(key, tensor):
        read[key] = read.get(key, 0) + tensor.nbytes

    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh, on_tensor=on_tensor)
    experts = model.layers[1].mlp.experts.down_proj[...]
    assert experts.sharding.spec == PartitionSpec(("tp", "dp"), None, None) and not experts.is_fully_addressable
    assert experts.addressable_shards[0].data.shape[0] == 1  # one expert per device

    reference = np.load(REFERENCE)
    steps = reference["steps"].shape[0]
    tokens, session = generate(model, mesh, reference["prompts"], steps, int(reference["page_size"]))
    assert session.cache.k[0].sharding.spec[1] == "tp"

    # the bytes this process must read: replicated tensors whole, sharded ones for its "tp" half only
    specs = model_partition_specs(model, mesh)
    total = expected = 0
    for key, (shape, dtype, _) in _headers(str(FIXTURE)).items():
        piece = checkpoint_pieces(key, model.config)
        if piece is None:
            continue
        nbytes = int(np.prod(shape)) * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
        total += nbytes
        axes = {a for entry in specs[piece.target] for a in (entry if isinstance(entry, tuple) else (entry,))}
        if "tp" not in axes:
            expected += nbytes
        elif piece.index and isinstance(piece.index[0], int):  # one expert of [E, ...]: whole or nothing
            per_process = model.config.num_local_experts // PROCESSES
            expected += nbytes if piece.index[0] // per_process == jax.process_index() else 0
        else:
            expected += nbytes // PROCESSES
    result = dict(
        process=jax.process_index(),
        tokens=np.asarray(tokens).tolist(),
        bytes_read=sum(read.values()),
        expected_bytes=expected,
        checkpoint_bytes=total,
        keys_read=sorted(read),
    )
    # the same model as MXFP8, kept in fp8: experts and their E8M0 scales over all 4 devices of both processes
    resident = MiniMaxM3.from_pretrained(Path(out).parent / "mxfp8", mesh=mesh)
    for name in ("down_proj", "down_proj_scale_inv"):
        stack = getattr(resident.layers[1].mlp.experts, name)[...]
        assert stack.sharding.spec == PartitionSpec(("tp", "dp"), None, None) and stack.dtype.itemsize == 1
        assert stack.addressable_shards[0].data.shape[0] == 1 and not stack.is_fully_addressable
    fp8_tokens, _ = generate(resident, mesh, reference["prompts"], steps, int(reference["page_size"]))
    result["fp8_tokens"] = np.asarray(fp8_tokens).tolist()
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


def test_two_processes_load_their_shards_and_decode_the_single_process_tokens(tmp_path):
    from jax_sparse_kv.nn import MiniMaxM3

    reference = np.load(REFERENCE)
    single, _ = generate(
        MiniMaxM3.from_pretrained(FIXTURE),
        None,
        reference["prompts"],
        reference["steps"].shape[0],
        int(reference["page_size"]),
    )
    np.testing.assert_array_equal(single, reference["tokens"])  # transformers' tokens

    from jax_sparse_kv.nn.params import quantize_weights
    from jax_sparse_kv.nn.quant import MXFP8
    from jax_sparse_kv.nn.weights import save_pretrained

    resident = quantize_weights(MiniMaxM3.from_pretrained(FIXTURE), MXFP8)
    save_pretrained(resident, tmp_path / "mxfp8", spelling="original")
    single_fp8, _ = generate(
        resident, None, reference["prompts"], reference["steps"].shape[0], int(reference["page_size"])
    )

    outs = [tmp_path / f"process{i}.json" for i in range(PROCESSES)]
    run_workers(__file__, outs)

    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        np.testing.assert_array_equal(np.array(r["tokens"]), single, err_msg=f"process {r['process']}")
        np.testing.assert_array_equal(np.array(r["fp8_tokens"]), single_fp8, err_msg=f"process {r['process']}")
        assert r["bytes_read"] == r["expected_bytes"], r
        assert r["bytes_read"] < r["checkpoint_bytes"]
        print(f"process {r['process']}: read {r['bytes_read']} of {r['checkpoint_bytes']} checkpoint bytes")
    # each process read its own experts' tensors and none of the other's
    expert_keys = [{k for k in r["keys_read"] if ".experts." in k} for r in results]
    assert expert_keys[0] and expert_keys[1] and not expert_keys[0] & expert_keys[1]


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
