"""Small layouts, the dtypes under test, a NumPy reference of the saturating cast, raw-bit views, and compiling
as users do."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bf16/fp8 with NumPy)
import numpy as np
from flax import nnx

import jax_sparse_kv as jsk

# XLA's own defaults for what tests/conftest.py changes (TEST_XLA_FLAGS) to compile the tests quicker.
USERS_XLA_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def compile_as_users_do(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered` compiled with XLA's default code generation, not the tests' quicker settings (tests/conftest.py):
    for the tests about the compiled program itself - its ops, memory and aliasing (XLA:CPU without its fusion
    emitters turns a scatter into a while loop)."""
    return lowered.compile(compiler_options=USERS_XLA_OPTIONS)


def model_call(
    model, tokens, positions, cache=None, page_table=None, *, image_features=None, image_index=None, aux_layer_ids=()
):
    """``model(tokens, positions, cache, page_table, ...)`` jitted: one program per model and shapes where an eager
    call compiles hundreds of one-op programs (measured, cold compilation cache: test_m3_vision's image prefill,
    cached prefill and 5 decode steps 14 s eagerly, 6 s jitted). ``images=`` runs the vision tower on the host's
    side first: pass ``model.image_inputs(tokens, images)`` as `image_features` / `image_index`, as it does."""
    graphdef, state = nnx.split(model)
    return _model_call(
        graphdef, state, tokens, positions, cache, page_table, image_features, image_index, aux_layer_ids
    )


# jax.jit over nnx.split's halves, not nnx.jit: flax 0.12.1 (the floor) hands jax 0.10 a keyword it no longer takes
@functools.partial(jax.jit, static_argnums=(0, 8))
def _model_call(graphdef, state, tokens, positions, cache, page_table, image_features, image_index, aux_layer_ids):
    return nnx.merge(graphdef, state)(
        tokens,
        positions,
        cache,
        page_table,
        image_features=image_features,
        image_index=image_index,
        aux_layer_ids=aux_layer_ids,
    )


DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def small_layout(**overrides) -> jsk.SparseKVLayout:
    """3 dense + 6 sparse layers (3-5 K-only, 6-8 keep index V), 4 pages of 8 slots."""
    fields = dict(
        dense_layer_ids=(0, 1, 2),
        sparse_layer_ids=(3, 4, 5, 6, 7, 8),
        k_only_layer_ids=(3, 4, 5),
        num_slots=32,
        page_size=8,
        head_num=2,
        head_dim=8,
        v_head_dim=6,
        index_head_dim=4,
        dtype=jnp.float32,
    )
    fields.update(overrides)
    return jsk.SparseKVLayout(**fields)


def reference_cast(x, dtype, scale=None) -> np.ndarray:
    """NumPy reference of the contract: divide by scale, saturate (NaN stays NaN), cast."""
    x = np.asarray(x, np.float32)
    if scale is not None:
        x = x / np.float32(scale)
    limit = (
        np.float32(np.finfo(np.dtype(dtype)).max)
        if np.dtype(dtype) != np.float32
        else np.float32(np.finfo(np.float32).max)
    )
    return np.clip(x, -limit, limit).astype(np.dtype(dtype))


def bits(x) -> np.ndarray:
    """The raw bits of an array, for bit-exact comparison (NaN == NaN)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
