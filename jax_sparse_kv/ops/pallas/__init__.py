"""Pallas decode-attention kernels for GPU (Triton) and TPU (Mosaic), and their dispatch.

- `paged_decode_attention`, `sparse_paged_decode_attention` (decode rows) and
  `paged_attention` (dense query blocks: prefill chunks, verifications): the dispatched ops
  (`platform.platform_switch`, a `jax.lax.platform_dependent` whose kernels are traced
  only when a program is lowered for their platform): the kernel on GPU/TPU, the XLA path of
  `jax_sparse_kv.ops.paged_decode` on CPU; ``use_pallas=False`` or
  ``JAX_SPARSE_KV_PALLAS=0`` forces XLA everywhere.
- `gpu_*` / `tpu_*`: the kernels themselves (``interpret=True`` runs them on CPU).
- `with_platform_kernels`, `pallas_enabled`, `xla_only`: the dispatch (from
  `jax_sparse_kv.platform`, which the write primitive uses too).
"""

from jax_sparse_kv.ops.pallas.dispatch import (
    PALLAS_ENV,
    over_heads,
    paged_attention,
    paged_decode_attention,
    pallas_enabled,
    pallas_possible,
    sparse_paged_decode_attention,
    with_platform_kernels,
    xla_only,
)
from jax_sparse_kv.ops.pallas.gpu_decode import (
    gpu_paged_attention,
    gpu_paged_decode_attention,
    gpu_sparse_paged_decode_attention,
    gpu_supports,
)
from jax_sparse_kv.ops.pallas.tpu_decode import (
    tpu_paged_attention,
    tpu_paged_decode_attention,
    tpu_sparse_paged_decode_attention,
    tpu_supports,
)

__all__ = [
    "PALLAS_ENV",
    "pallas_enabled",
    "pallas_possible",
    "xla_only",
    "over_heads",
    "with_platform_kernels",
    "paged_decode_attention",
    "sparse_paged_decode_attention",
    "paged_attention",
    "gpu_paged_decode_attention",
    "gpu_paged_attention",
    "gpu_sparse_paged_decode_attention",
    "gpu_supports",
    "tpu_paged_decode_attention",
    "tpu_paged_attention",
    "tpu_sparse_paged_decode_attention",
    "tpu_supports",
]
