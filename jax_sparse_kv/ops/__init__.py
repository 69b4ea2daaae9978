"""Attention ops in pure JAX that read K/V through a `KVSource`.

- `dense_attention`: causal grouped-query attention (prefill and decode).
- `indexer_select`: MiniMax indexer block scores and top-k block selection.
- `block_sparse_attention`: attention over the selected blocks only.

Decode and prefill read only the live pages of each sequence, chunk by chunk
with an online softmax (`paged_decode`: `paged_decode_attention`,
`sparse_paged_decode_attention`, the lower-level entries the Pallas kernels mirror).
A decode step (one query per sequence over paged K/V) of `dense_attention` or
`block_sparse_attention` runs the Pallas kernel of `ops.pallas` on GPU and TPU,
picked inside the program by the platform it is lowered for (`platform.platform_switch`);
CPU runs the XLA path, and a program jitted on CPU never traces a kernel.

Sources: `PagedKV` (a cache buffer and a page table) or `ContiguousKV`
(freshly computed K/V), so the same op runs in decoding and in the full
forward pass it is checked against. All shapes are static.
"""

from jax_sparse_kv.ops.block_sparse import block_sparse_attention
from jax_sparse_kv.ops.dense import dense_attention, masked_softmax_weights
from jax_sparse_kv.ops.indexer import block_scores, indexer_select, select_blocks
from jax_sparse_kv.ops.kv_source import ContiguousKV, KVSource, PagedKV
from jax_sparse_kv.ops.paged_decode import paged_decode_attention, sparse_paged_decode_attention
from jax_sparse_kv.paging import token_slots  # re-exported: ops callers map positions to slots

__all__ = [
    "dense_attention",
    "masked_softmax_weights",
    "block_scores",
    "select_blocks",
    "indexer_select",
    "block_sparse_attention",
    "paged_decode_attention",
    "sparse_paged_decode_attention",
    "ContiguousKV",
    "PagedKV",
    "KVSource",
    "token_slots",
]
