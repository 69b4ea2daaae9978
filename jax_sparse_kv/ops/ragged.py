"""Ragged batches: tokens of many sequences flattened into one axis (the shape of ragged paged attention).

A serving step mixes prefill chunks and decode tokens of different sequences.
Its metadata, as in tpu-inference's ragged paged attention:

- ``cu_q_lens [num_seqs + 1]``: sequence ``s`` owns flattened tokens
  ``cu_q_lens[s] : cu_q_lens[s + 1]`` (its new tokens, in position order);
- ``kv_lens [num_seqs]``: tokens of sequence ``s`` in the cache *after* this
  step (its new tokens are the last ``q_len`` of them);
- ``page_indices [num_seqs, max_pages]``: each sequence's page table.

`ragged_token_rows` turns that into one row per token (its position and its
sequence's page table), which is exactly a decode step of ``num_tokens`` rows:
the attention ops then read, for each token, only the live pages up to its own
position (compute and reads scale with the tokens processed, not with
``num_seqs x longest chunk``), a prefill chunk attends to earlier chunks and to
itself through the cache, and on GPU/TPU every row goes through the Pallas
decode kernels. Tokens past ``cu_q_lens[-1]`` (bucket padding) get position
``-1`` and read nothing.

Attention itself may group the flat tokens (`AttentionGroups`): a lone token
of a sequence (a decode step) stays a decode row (the Pallas decode kernels on
GPU/TPU), while the tokens of a prefill chunk (or of a speculative
verification) attend in query blocks of consecutive tokens of one sequence,
so each block reads its sequence's pages once for all its queries. On CPU a
verification's few tokens form one row of the decode group instead (a row of
``R`` queries: dense attention and the indexer read its pages once, sparse
attention takes its queries one by one, all rows at once). Everything else in
a layer (projections, MLPs) stays on the flat token axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

__all__ = ["ragged_token_rows", "AttentionGroups"]


def ragged_token_rows(
    cu_q_lens: jax.Array, kv_lens: jax.Array, page_indices: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token ``(seq_ids [T], positions [T], page_table [T, max_pages])`` of a ragged batch.

    Args:
      cu_q_lens: ``[S + 1]`` int32, non-decreasing, ``cu_q_lens[0] = 0``; padded
        sequences repeat the last offset (zero new tokens).
      kv_lens: ``[S]`` int32 cache length of each sequence after this step.
      page_indices: ``[S, max_pages]`` int32 page ids (0 = the padding page).
      num_tokens: static ``T``, the flattened token axis (a bucket >= ``cu_q_lens[-1]``).

    Returns:
      ``seq_ids``: the sequence of each token (padding tokens: 0);
      ``positions``: ``kv_lens[s] - (cu_q_lens[s + 1] - t)`` for token ``t`` of
      sequence ``s``, ``-1`` for padding tokens; ``page_table``: row ``t`` is
      ``page_indices[seq_ids[t]]`` (the padding page for padding tokens).
    """
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = kv_lens.shape[0]
    # token t belongs to the last sequence whose start is <= t (empty sequences are skipped)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    real = t < cu_q_lens[-1]
    seq = jnp.where(real, jnp.minimum(seq, num_seqs - 1), 0)
    positions = jnp.where(real, kv_lens.astype(jnp.int32)[seq] - (cu_q_lens[seq + 1] - t), -1)
    table = jnp.where(real[:, None], page_indices.astype(jnp.int32)[seq], 0)
    return seq, positions, table


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["decode", "decode_table", "blocks", "block_table"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class AttentionGroups:
    """How attention groups the ``T`` flat tokens of a ragged step (indices ``>= T`` mean none).

    Attributes:
      decode: ``[D, R]`` the tokens of each decode row: one sequence's at most ``R`` new tokens (``R = 1``: its
        lone token of a decode step; ``R > 1`` on CPU: a verification's ``1 + drafts`` tokens).
      decode_table: ``[D, max_pages]`` its sequence's pages.
      blocks: ``[B, Q]`` query blocks: consecutive tokens of one sequence each.
      block_table: ``[B, max_pages]`` each block's sequence's pages.
    """

    decode: jax.Array
    decode_table: jax.Array
    blocks: jax.Array
    block_table: jax.Array

    def groups(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """``((token indices [rows, q], page table [rows, max_pages]), ...)`` of the decode rows and the blocks."""
        return (self.decode, self.decode_table), (self.blocks, self.block_table)

    @staticmethod
    def gather(x: jax.Array, index: jax.Array, fill: float | int = 0) -> jax.Array:
        """``x [T, ...]`` -> ``[rows, q, ...]`` at `index` (`fill` where the index is none)."""
        return x.at[index].get(mode="fill", fill_value=fill)

    def scatter(self, parts: list[jax.Array], num_tokens: int) -> jax.Array:
        """Group outputs ``[rows, q, ...]`` (in `groups` order, empty groups left out) back onto ``[T, ...]``."""
        out = jnp.zeros((num_tokens,) + parts[0].shape[2:], parts[0].dtype)
        present = [index for index, _ in self.groups() if index.shape[0]]  # a group may be empty in a program
        for index, part in zip(present, parts, strict=True):
            out = out.at[index.reshape(-1)].set(part.reshape((-1,) + part.shape[2:]), mode="drop")
        return out
