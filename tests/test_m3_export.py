"""The model's jitted decode step exports for GPU and TPU with the Pallas decode kernels inside.

One program carries a kernel per platform (`jax.lax.platform_dependent`); on CPU
it runs the XLA path. Exported for one platform at a time (see
tests/test_pallas_export.py for why), on this CPU-only machine.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jax_sparse_kv as jsk
from jax_sparse_kv.nn import MiniMaxM3, make_step, tiny_config
from jax_sparse_kv.ops.pallas import PALLAS_ENV

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"

# head_dim 128 and 4 bf16 KV heads: shapes the TPU kernel tiles (smaller ones fall back to XLA there)
CONFIG = tiny_config(
    "ds",
    "dm",
    num_attention_heads=8,
    num_key_value_heads=4,
    index_n_heads=4,
    head_dim=128,
    rotary_dim=64,
    index_head_dim=128,
    index_block_size=32,
    index_topk_blocks=2,
)


def _export_decode_step(platform: str) -> tuple[set[str], str]:
    model = MiniMaxM3(CONFIG, seed=0, dtype=jnp.bfloat16)
    step = make_step(model)
    layout = CONFIG.layout(num_slots=8 * 32, page_size=32, dtype=jnp.bfloat16)
    args = (
        step.params,
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        jsk.SparseKVCache.abstract(layout),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
    )
    exported = export.export(
        step.fn, platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
    )(*args)
    text = exported.mlir_module()
    return set(re.findall(r"custom_call @([\w$.]+)", text)), text


@pytest.mark.parametrize("platform, target", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_model_decode_step_exports_with_kernels(platform, target):
    calls, text = _export_decode_step(platform)
    assert target in calls
    # one dense layer and one sparse layer: a kernel call for each
    assert len(re.findall(rf"custom_call @{re.escape(target)}", text)) >= 2


def test_forcing_xla_keeps_kernels_out(monkeypatch):
    monkeypatch.setenv(PALLAS_ENV, "0")
    calls, _ = _export_decode_step("cuda")
    assert TRITON not in calls


@pytest.mark.parametrize("platform, target", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_serving_ragged_step_exports_with_kernels(platform, target):
    """The engine's ragged step (every token a decode row over its sequence's pages) carries the decode kernels."""
    from jax_sparse_kv import serving

    model = MiniMaxM3(CONFIG, seed=0, dtype=jnp.bfloat16)
    eng = serving.Engine(
        model, num_pages=8, page_size=32, dtype=jnp.bfloat16, max_seqs=2, max_tokens_per_step=16, max_model_len=256
    )
    inputs, _ = eng.shapes.inputs([])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)
    # None: no penalties, no previous step
    args = (eng.runner.params, jsk.SparseKVCache.abstract(eng.runner.layout), abstract, None, None, None)
    exported = export.export(
        eng.runner._fn, platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
    )(*args)
    assert len(re.findall(rf"custom_call @{re.escape(target)}", exported.mlir_module())) >= 2
