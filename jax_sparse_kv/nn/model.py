"""`MiniMaxLikeModel`: a small decoder with dense and sparse (indexer) attention layers.

Functional at its boundary: ``logits, cache = model(tokens, positions, cache, page_table)``.
Random initialisation from a seed; no weights are downloaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.nn.config import ModelConfig
from jax_sparse_kv.nn.layers import MLP, Attention, KVPrecision

__all__ = ["DecoderLayer", "MiniMaxLikeModel"]


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_id: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps, rngs=rngs)
        self.attn = Attention(config, layer_id, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps, rngs=rngs)
        self.mlp = MLP(config.hidden_size, config.mlp_dim, rngs=rngs)

    def __call__(self, x, positions, cache, page_table, precision):
        h, cache, selected = self.attn(self.attn_norm(x), positions, cache, page_table, precision)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache, selected


class MiniMaxLikeModel(nnx.Module):
    """Embedding, decoder layers (dense and sparse, by `ModelConfig`), final norm, LM head.

    The layers may cover a pipeline stage only: ``layer_ids`` (absolute ids)
    chooses which are kept. Every stage draws all weights from the same seed in
    the same order, so stage models share the weights of one full model; a stage
    runs `forward_layers` (the first also `embed`, the last `head`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ):
        rngs = nnx.Rngs(seed)
        self.config = config
        self.layer_ids = config.layer_ids if layer_ids is None else tuple(layer_ids)
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        # build every layer so that each layer's weights depend on the seed only, not on the stage
        layers = {i: DecoderLayer(config, i, rngs=rngs) for i in config.layer_ids}
        self.layers = nnx.List([layers[i] for i in self.layer_ids])
        self.final_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: SparseKVCache | None = None,
        page_table: jax.Array | None = None,
        *,
        kv_scale: float = 1.0,
        precision: KVPrecision | None = None,
        return_selection: bool = False,
    ):
        """Runs the decoder over ``tokens`` and reads/writes the cache.

        Args:
          tokens: ``[batch, seq]`` int token ids (any value for padding).
          positions: ``[batch, seq]`` absolute positions; ``-1`` marks padding.
            Prefill passes ``0..n-1``, a decode step the next position.
          cache: the `SparseKVCache` to write and read; ``None`` runs the full
            forward pass over ``tokens`` alone (then row ``t`` must be at
            position ``t`` or padding).
          page_table: ``[batch, max_pages]`` page ids of each sequence (with a cache).
          kv_scale: scale for casting writes into fp8/bf16 pools.
          precision: for the cache-free pass, the pool dtypes to emulate
            (defaults to f32, or to the cache's dtypes when a cache is given).
          return_selection: also return ``{layer_id: [batch, seq, kv_heads, topk]}``
            block ids chosen by each sparse layer's indexer.

        Returns:
          ``(logits [batch, seq, vocab] f32, cache)``, plus the selections if asked.
        """
        if cache is not None:
            self.config.check_layout(cache.layout)
            if page_table is None:
                raise ValueError("page_table is required with a cache")
            precision = KVPrecision.of(cache.layout, kv_scale)
        elif precision is None:
            precision = KVPrecision(scale=kv_scale)
        x, cache, selections = self.forward_layers(self.embed(tokens), positions, cache, page_table, precision)
        logits = self.head(x)
        if return_selection:
            return logits, cache, selections
        return logits, cache

    def forward_layers(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: SparseKVCache | None,
        page_table: jax.Array | None,
        precision: KVPrecision,
    ) -> tuple[jax.Array, SparseKVCache | None, dict[int, jax.Array]]:
        """This model's decoder layers on hidden states ``x [batch, seq, hidden]``.

        A pipeline stage calls this alone: stage ``i`` feeds its output to
        stage ``i + 1``, each with the cache of its own stage layout.

        Returns:
          ``(x, cache, selections)`` with ``selections`` as in ``__call__``.
        """
        selections = {}
        for layer in self.layers:
            x, cache, selected = layer(x, positions, cache, page_table, precision)
            if selected is not None:
                selections[layer.attn.layer_id] = selected
        return x, cache, selections

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: ``[batch, seq, hidden] -> [batch, seq, vocab]`` f32."""
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)
