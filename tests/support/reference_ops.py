"""The slow reference ops (the first implementation) the chunked ops are compared with."""

from jax_sparse_kv.ops._reference import block_scores, block_sparse_attention, dense_attention

__all__ = ["dense_attention", "block_scores", "block_sparse_attention"]
