"""Loading a MiniMax-M3 checkpoint straight into shards on 8 CPU devices: same logits as one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_sparse_kv as jsk
from jax_sparse_kv.nn import DecodeSession, MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.nn.weights import save_pretrained

CONFIG = tiny_config(
    "dsds",
    "dmmm",
    num_attention_heads=8,
    num_key_value_heads=4,
    index_n_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    head_dim=16,
)


def assert_same_decode(single: MiniMaxM3, sharded: MiniMaxM3, mesh) -> None:
    """Greedy tokens equal and logits within 1e-5 (relative) through `make_step`, one device vs the mesh."""
    prompts = [list(range(3, 20)), list(range(40, 51))]
    table = jnp.asarray(np.arange(1, 9).reshape(2, 4), jnp.int32)
    results = []
    for model, m in ((single, None), (sharded, mesh)):
        layout = CONFIG.layout(num_slots=8 * 8, page_size=8, dtype=jnp.float32)
        session = DecodeSession(make_step(model, mesh=m), jsk.SparseKVCache.zeros(layout, mesh=m), table)
        results.append(session.generate(prompts, 6))
    (tokens_1, logits_1), (tokens_8, logits_8) = results
    np.testing.assert_array_equal(tokens_1, tokens_8)
    worst = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(logits_1, logits_8, strict=True))
    assert worst < 1e-5


def test_sharded_load_equals_single_device(tmp_path):
    save_pretrained(MiniMaxM3(CONFIG, seed=5), tmp_path, spelling="original", max_shard_bytes=200_000)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    single = MiniMaxM3.from_pretrained(tmp_path)
    sharded = MiniMaxM3.from_pretrained(tmp_path, mesh=mesh)

    params = hf_params(sharded)
    assert params["model.layers.1.self_attn.q_proj.weight"][...].sharding.spec == P("tp", None)
    assert params["model.layers.1.self_attn.o_proj.weight"][...].sharding.spec == P(None, "tp")
    experts = params["model.layers.1.mlp.experts.gate_up_proj"][...]
    assert experts.sharding.spec == P("tp", None, None)
    assert experts.addressable_shards[0].data.shape == (2, 2 * CONFIG.intermediate_size, CONFIG.hidden_size)
    assert params["model.layers.1.self_attn.indexer.k_proj.weight"][...].sharding.is_fully_replicated

    assert_same_decode(single, sharded, mesh)


def test_mxfp8_resident_experts_over_all_8_devices_equal_one_device(tmp_path):
    """An MXFP8 checkpoint kept in fp8 (values + E8M0 scales) on a ("ep", "tp") 2 x 4 mesh: 4 KV heads on tp,
    8 experts one per device with their scales beside them; greedy tokens and logits equal one device's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.fp8_checkpoints import write_mxfp8_checkpoint

    write_mxfp8_checkpoint(MiniMaxM3(CONFIG, seed=6), tmp_path)
    mesh = jax.make_mesh((2, 4), ("ep", "tp"))
    single = MiniMaxM3.from_pretrained(tmp_path)
    sharded = MiniMaxM3.from_pretrained(tmp_path, mesh=mesh)
    params = hf_params(sharded)
    experts, scales = (params[f"model.layers.1.mlp.experts.gate_up_proj{s}"][...] for s in ("", "_scale_inv"))
    assert experts.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.uint8
    assert experts.addressable_shards[0].data.shape[0] == 1 and scales.addressable_shards[0].data.shape[0] == 1
    q = params["model.layers.1.self_attn.q_proj.weight_scale_inv"][...]
    assert q.sharding.spec == P("tp", None) and q.addressable_shards[0].data.shape == (32, 2)

    assert_same_decode(single, sharded, mesh)
