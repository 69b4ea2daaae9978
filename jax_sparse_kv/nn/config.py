"""`ModelConfig`: the static shape of the small MiniMax-like decoder."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_sparse_kv.layout import SparseKVLayout

__all__ = ["ModelConfig", "demo_config"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes, layer groups and indexer settings of `MiniMaxLikeModel`.

    Layer groups use the same absolute ids as `SparseKVLayout`: dense layers
    attend to every earlier token; sparse layers run the indexer (one shared
    index K head, ``index_heads`` index query heads) and attend to ``topk_blocks``
    blocks of ``block_size`` tokens per KV head; sparse layers not in
    ``k_only_layer_ids`` also keep index V and add an index-attention branch.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    dense_layer_ids: tuple[int, ...] = (0,)
    sparse_layer_ids: tuple[int, ...] = (1, 2, 3)
    k_only_layer_ids: tuple[int, ...] = (1, 3)
    index_heads: int = 2
    index_dim: int = 16
    block_size: int = 8
    topk_blocks: int = 3
    init_blocks: int = 1
    local_blocks: int = 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 or self.index_dim % 2:
            raise ValueError("head_dim and index_dim must be even (rotary embedding)")
        if self.topk_blocks < self.init_blocks + self.local_blocks:
            raise ValueError(
                f"topk_blocks={self.topk_blocks} must be >= init_blocks + local_blocks "
                f"= {self.init_blocks + self.local_blocks}"
            )
        a, b = self.index_heads, self.num_kv_heads
        if a % b and b % a:
            raise ValueError(f"index_heads={a} and num_kv_heads={b}: one must divide the other")
        # validates the ids (disjoint, K-only subset of sparse) with the layout's own rules
        self.layout(num_slots=self.block_size, page_size=self.block_size)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.dense_layer_ids + self.sparse_layer_ids))

    def layout(self, num_slots: int, page_size: int, dtype: Any = "float32", **overrides: Any) -> SparseKVLayout:
        """The cache layout this model reads and writes (stage, index dtype via `overrides`)."""
        return SparseKVLayout(
            dense_layer_ids=self.dense_layer_ids,
            sparse_layer_ids=self.sparse_layer_ids,
            k_only_layer_ids=self.k_only_layer_ids,
            num_slots=num_slots,
            page_size=page_size,
            head_num=self.num_kv_heads,
            head_dim=self.head_dim,
            index_head_dim=self.index_dim,
            dtype=dtype,
            **overrides,
        )

    def check_layout(self, layout: SparseKVLayout) -> None:
        """Raises `ValueError` if `layout` does not describe this model's layers and heads."""
        expected = dict(
            dense_layer_ids=tuple(sorted(self.dense_layer_ids)),
            sparse_layer_ids=tuple(sorted(self.sparse_layer_ids)),
            k_only_layer_ids=tuple(sorted(self.k_only_layer_ids)),
            head_num=self.num_kv_heads,
            head_dim=self.head_dim,
            v_head_dim=self.head_dim,
            index_head_dim=self.index_dim,
        )
        wrong = {k: (v, getattr(layout, k)) for k, v in expected.items() if getattr(layout, k) != v}
        if wrong:
            detail = "; ".join(f"{k}: model {m}, layout {c}" for k, (m, c) in wrong.items())
            raise ValueError(f"cache layout does not match the model: {detail}")


def demo_config() -> ModelConfig:
    """The demo's model: 3 dense + 5 sparse layers (K-only and index-V alternating), 8 KV heads."""
    sparse = tuple(range(3, 8))
    return ModelConfig(
        vocab_size=512, hidden_size=128, num_heads=16, num_kv_heads=8, head_dim=16, mlp_dim=256,
        dense_layer_ids=(0, 1, 2), sparse_layer_ids=sparse, k_only_layer_ids=sparse[::2],
        index_heads=4, index_dim=32, block_size=16, topk_blocks=4, init_blocks=1, local_blocks=1,
    )  # fmt: skip
