"""MiniMax-M3 (text) in Flax NNX, reading and writing a `SparseKVCache`.

The architecture of transformers' `MiniMaxM3VLForCausalLM` (its reference),
top to bottom:

- Gemma-style RMSNorm: normalise in f32, scale by ``1 + weight``.
- Attention: q/k/v projections, per-head q/k RMSNorm, then partial NeoX
  (half-split) RoPE on the first ``rotary_dim`` channels (YaRN-scaled
  frequencies and cos/sin when ``config.rope_scaling`` is set); GQA with
  softmax scale ``head_dim ** -0.5``.
- Sparse layers add the lightning indexer: its own q (``index_n_heads``) and k
  (one head) projections and norms, RoPE from the same cos/sin, f32 scores
  without a scale, a per-token causal mask, max-pool per block of
  ``index_block_size`` keys; the query's own block and the
  ``index_local_blocks - 1`` before it are forced and count in the top
  ``index_topk_blocks``; no init blocks; one selection per index head, ``-1``
  padded. Main attention then reads only the selected blocks (causal inside).
- MLPs: SwiGLU-OAI (``gate`` clamped above, ``up`` clamped both ways,
  ``(up + 1) * gate * sigmoid(alpha * gate)``), dense or MoE per layer. MoE:
  sigmoid router, ``e_score_correction_bias`` used only to choose experts,
  chosen weights renormalised and scaled by ``routed_scaling_factor``, plus
  one ungated shared expert.
- Final norm and LM head (tied to the embedding when the config says so).

Parameter names and layouts are transformers' (``weight`` is ``[out, in]``;
experts ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), so the
checkpoint-name map in `jax_sparse_kv.nn.weights` is a list of renames.

Functional at its boundary: ``logits, cache = model(tokens, positions, cache, page_table)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv import ops, platform
from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.nn import params
from jax_sparse_kv.nn.config import MiniMaxM3Config, YarnScaling
from jax_sparse_kv.nn.init import Init
from jax_sparse_kv.nn.precision import KVPrecision
from jax_sparse_kv.nn.quant import BlockQuant, dequantize, mxfp8_matmul
from jax_sparse_kv.nn.vision import MultiModalProjector, VisionTower, patch_bucket, vision_inputs
from jax_sparse_kv.nn.weights import load_pretrained
from jax_sparse_kv.ops.ragged import AttentionGroups
from jax_sparse_kv.paging import token_slots
from jax_sparse_kv.sharding import explicit_mesh, on_auto_axes, spec_of

__all__ = [
    "Embedding",
    "RMSNorm",
    "Linear",
    "rope_cos_sin",
    "apply_rope",
    "swiglu_oai",
    "DenseMLP",
    "SparseMoE",
    "Indexer",
    "Attention",
    "DecoderLayer",
    "MiniMaxM3",
]


class Linear(nnx.Module):
    """``y = x @ weight.T``, ``weight [out, in]`` as in the checkpoint (no transpose on load).

    Quantized (`jax_sparse_kv.nn.params.quantize_param`, ``quant`` set): ``weight`` holds fp8 values and
    ``weight_scale_inv`` their block scales (`jax_sparse_kv.nn.quant`), dequantized to the activations' dtype
    inside the matmul, or multiplied in fp8 when ``quant.dot`` is ``"mxfp8_dot"``.
    """

    quantizable = ("weight",)  # what may be held as fp8 + block scales

    def __init__(self, in_features: int, out_features: int, *, init: Init):
        self.weight = init.normal(out_features, in_features)
        self.quant: BlockQuant | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        if self.quant is not None and self.quant.dot == "mxfp8_dot":
            return mxfp8_matmul(x, w, self.weight_scale_inv[...])
        if self.quant is not None:
            w = dequantize(w, self.weight_scale_inv[...], self.quant, x.dtype)
        return jnp.einsum("...i,oi->...o", x, w)


class Embedding(nnx.Module):
    """Token embedding table ``weight [vocab, hidden]``."""

    def __init__(self, vocab: int, hidden: int, *, init: Init):
        self.weight = init.normal(vocab, hidden)


class RMSNorm(nnx.Module):
    """Gemma-style RMSNorm over the last axis: f32 ``x / rms(x) * (1 + weight)``, cast back."""

    def __init__(self, dim: int, eps: float, *, init: Init):
        self.weight = init.zeros(dim)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def rope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float, scaling: YarnScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [batch, seq, rotary_dim]`` f32 at ``positions [batch, seq]`` (frequencies repeated twice).

    With `scaling` (YaRN) the frequencies are `YarnScaling.inv_freq` and cos / sin are multiplied by its
    ``attention_scaling``, as transformers' rotary embedding does (so q and k each carry it: the logits
    of the rotated channels by its square).
    """
    if scaling is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    else:
        inv_freq = jnp.asarray(scaling.inv_freq(rotary_dim, theta))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scaling is not None and scaling.attention_scaling != 1.0:
        cos, sin = cos * scaling.attention_scaling, sin * scaling.attention_scaling
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX (half-split) rotation of the first ``cos.shape[-1]`` channels of ``x [batch, seq, heads, dim]``."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([(rot * cos + rotated * sin).astype(x.dtype), rest], axis=-1)


def swiglu_oai(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """``[..., 2I] -> [..., I]``: ``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


class DenseMLP(nnx.Module):
    """SwiGLU-OAI MLP: ``down_proj(swiglu_oai(gate_up_proj(x)))``; gate and up are fused (gate first)."""

    def __init__(self, config: MiniMaxM3Config, intermediate: int, *, init: Init):
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, init=init)
        self.down_proj = Linear(intermediate, config.hidden_size, init=init)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class Router(nnx.Module):
    """Sigmoid router; ``e_score_correction_bias`` shifts the choice only, not the weights."""

    def __init__(self, config: MiniMaxM3Config, *, init: Init):
        self.weight = init.normal(config.num_local_experts, config.hidden_size)
        self.e_score_correction_bias = init.zeros(config.num_local_experts, dtype=np.float32)
        self.top_k = config.num_experts_per_tok

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [tokens, hidden]`` -> ``(weights [tokens, k] f32, experts [tokens, k] int32)``."""
        logits = jnp.einsum("th,eh->te", x, self.weight[...]).astype(jnp.float32)
        probs = jax.nn.sigmoid(logits)
        _, experts = jax.lax.top_k(probs + self.e_score_correction_bias[...], self.top_k)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
        return weights / jnp.sum(weights, axis=-1, keepdims=True), experts


#: Largest ``[experts, tokens, 2 * intermediate]`` activation of `Experts._every_expert` (CPU, small steps).
EVERY_EXPERT_ELEMENTS = 1 << 22


class Experts(nnx.Module):
    """Routed experts as stacked weights: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    Expert parallel (`jax_sparse_kv.nn.parallel.shard_model` sets ``expert_parallel = (mesh, axes)``): the
    experts split over the devices of `axes` (E / devices each), every device runs its own experts on
    every token (tokens are replicated) and one ``psum`` over `axes` adds the contributions: no expert's
    weights ever leave their device. Under data-parallel attention (an expert axis already manual: the step
    runs per group, `jax_sparse_kv.serving.Engine`'s ``data_parallel_axis``) the groups' tokens are first
    all-gathered over that axis, and each token's sum is reduce-scattered back to its group, then added over
    the group's own devices.
    """

    quantizable = ("gate_up_proj", "down_proj")  # held as fp8 + block scales together (one ``quant``)

    def __init__(self, config: MiniMaxM3Config, *, init: Init):
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = init.normal(e, 2 * i, h)
        self.down_proj = init.normal(e, h, i)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.expert_parallel: tuple[Any, tuple[str, ...]] | None = None  # (mesh, axes), static
        self.quant: BlockQuant | None = None  # set: fp8 values + ``*_scale_inv`` block scales (`params.quantize_param`)

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` for ``x [tokens, hidden]``."""
        stacks = (self.gate_up_proj[...], self.down_proj[...])
        if self.quant is not None:
            stacks += (self.gate_up_proj_scale_inv[...], self.down_proj_scale_inv[...])
        if self.expert_parallel is None:
            return self._routed(x, weights, experts, *stacks)
        mesh, axes = self.expert_parallel
        context = jax.sharding.get_abstract_mesh()  # under `call_on_auto_axes`: the mesh with Auto axes
        mesh = mesh if context.empty else context
        # data-parallel attention (`jax_sparse_kv.serving.Engine`'s ``data_parallel_axis``): the step runs per group
        # of devices (a manual axis) and each group holds a share of the experts: tokens of every group meet
        # (all-gather), then each token's sum comes back to its group (reduce-scatter)
        groups = tuple(a for a in axes if not context.empty and a in context.manual_axes)
        inner = tuple(a for a in axes if a not in groups)
        spec = jax.sharding.PartitionSpec(inner or None)
        rep = jax.sharding.PartitionSpec()

        def local(x, weights, experts, *stacks):
            if groups:
                x, weights, experts = (jax.lax.all_gather(a, groups, axis=0, tiled=True) for a in (x, weights, experts))
            n = stacks[0].shape[0]  # this device's experts: ids [first, first + n)
            ids = experts - jax.lax.axis_index(axes) * n
            mine = (ids >= 0) & (ids < n)
            y = self._routed(x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids, n), *stacks).astype(jnp.float32)
            if groups:  # each group's own tokens first: the sum within the group then adds 1 / groups of the rows
                y = jax.lax.psum_scatter(y, groups, scatter_dimension=0, tiled=True)
            if inner:
                y = jax.lax.psum(y, inner)
            return y.astype(x.dtype)

        if not inner:  # every expert axis is already manual
            return local(x, weights, experts, *stacks)
        free = {a for a in mesh.axis_names if context.empty or a not in context.manual_axes}
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rep, rep, rep) + (spec,) * len(stacks),
            out_specs=rep,
            axis_names=free,
            check_vma=False,
        )(x, weights, experts, *stacks)

    def _weights(self, stack: jax.Array, scale: jax.Array | None, dtype: Any) -> jax.Array:
        return stack if scale is None else dequantize(stack, scale, self.quant, dtype)

    def _routed(self, x, weights, experts, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None) -> jax.Array:
        """The routed sum over experts ``[0, E)`` of the given weights; an id ``E`` is no expert (weight 0).

        Quantized stacks come with their scales: a decode step dequantizes the chosen experts only, a
        prefill step the layer's stack (transiently, inside the step).
        """
        tokens, k = experts.shape
        num_experts = gate_up_proj.shape[0]
        if tokens * k <= num_experts:
            # decode: read only the chosen experts' weights (what a step must read)
            chosen = jnp.minimum(experts, num_experts - 1)
            pick = lambda s: None if s is None else s[chosen]  # noqa: E731
            gate_up = self._weights(gate_up_proj[chosen], pick(gate_up_scale), x.dtype)  # [t, k, 2I, H]
            down = self._weights(down_proj[chosen], pick(down_scale), x.dtype)
            h = swiglu_oai(jnp.einsum("th,tkih->tki", x, gate_up), self.alpha, self.limit)
            y = jnp.einsum("tki,tkhi->tkh", h, down)
            return jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights).astype(x.dtype)
        gate_up_proj = self._weights(gate_up_proj, gate_up_scale, x.dtype)
        down_proj = self._weights(down_proj, down_scale, x.dtype)
        args = (x, weights, experts, gate_up_proj, down_proj)
        if tokens * gate_up_proj.shape[0] * gate_up_proj.shape[1] > EVERY_EXPERT_ELEMENTS:
            return self._grouped(*args)
        return platform.platform_switch(args, cpu=lambda a: self._every_expert(*a), default=lambda a: self._grouped(*a))

    def _every_expert(self, x, weights, experts, gate_up_proj, down_proj) -> jax.Array:
        """Every expert on every token, each token's output the routing-weighted sum of its chosen ones (CPU).

        On CPU a ragged dot lowers to a dense dot over every expert anyway (a masked copy of the token rows per
        expert, the stacks transposed on every call); batched over experts, the stacks are read as stored
        (faster: BENCHMARKS.md, "Design measurements behind the CPU code paths")."""
        tokens, num_experts = x.shape[0], gate_up_proj.shape[0]
        # [tokens, E] routing weights, 0 for experts not chosen (an id E, no expert, is dropped)
        dense = jnp.zeros((tokens, num_experts), jnp.float32)
        dense = dense.at[jnp.arange(tokens)[:, None], experts].add(weights.astype(jnp.float32), mode="drop")
        h = swiglu_oai(jnp.einsum("th,eih->eti", x, gate_up_proj), self.alpha, self.limit)
        y = jnp.einsum("eti,ehi->eth", h, down_proj).astype(jnp.float32)
        return jnp.einsum("eth,te->th", y, dense).astype(x.dtype)

    def _grouped(self, x, weights, experts, gate_up_proj, down_proj) -> jax.Array:
        """Token copies sorted by expert through grouped (ragged) matmuls: each expert on its own tokens."""
        tokens, k = experts.shape
        num_experts = gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat)
        token_of = order // k
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # id E counts in no group
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
        )
        h = jax.lax.ragged_dot_general(x[token_of], gate_up_proj, group_sizes, dims)
        h = swiglu_oai(h, self.alpha, self.limit)
        y = jax.lax.ragged_dot_general(h, down_proj, group_sizes, dims).astype(jnp.float32)
        in_group = (flat[order] < num_experts)[:, None]
        y = jnp.where(in_group, y * weights.reshape(-1)[order][:, None], 0.0)
        return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


class SparseMoE(nnx.Module):
    """``routed_scaling_factor * experts(x) + shared_experts(x)``."""

    def __init__(self, config: MiniMaxM3Config, *, init: Init):
        self.gate = Router(config, init=init)
        self.experts = Experts(config, init=init)
        self.shared_experts = DenseMLP(config, config.shared_intermediate_size, init=init)
        self.scale = config.routed_scaling_factor

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.gate(x)
        routed = self.experts(x, weights, experts)
        return (routed * self.scale + self.shared_experts(x)).reshape(shape)


class Indexer(nnx.Module):
    """The lightning indexer's projections: ``index_n_heads`` query heads, one key head.

    With the index-V option (SGLang's ``sparse_disable_index_value = 0``) it
    also has ``v_proj`` (one head) and ``o_proj``, and the layer adds
    ``o_proj(causal attention of the index queries over index K/V)``.
    """

    def __init__(self, config: MiniMaxM3Config, index_value: bool, *, init: Init):
        c = config
        self.q_proj = Linear(c.hidden_size, c.index_n_heads * c.index_head_dim, init=init)
        self.k_proj = Linear(c.hidden_size, c.index_head_dim, init=init)
        self.q_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps, init=init)
        self.k_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps, init=init)
        if index_value:
            self.v_proj = Linear(c.hidden_size, c.index_head_dim, init=init)
            self.o_proj = Linear(c.index_n_heads * c.index_head_dim, c.hidden_size, init=init)


class Attention(nnx.Module):
    """Dense or sparse (indexer + block-sparse) attention of one absolute layer id."""

    def __init__(self, config: MiniMaxM3Config, layer_id: int, *, init: Init):
        c = config
        self.config = c
        self.layer_id = layer_id
        self.sparse = layer_id in c.sparse_layer_ids
        self.index_value = self.sparse and not c.disable_index_value[layer_id]
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, init=init)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, init=init)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, init=init)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, init=init)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, init=init)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, init=init)
        if self.sparse:
            self.indexer = Indexer(c, self.index_value, init=init)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        cache: SparseKVCache | None,
        page_table: jax.Array | None,
        precision: KVPrecision,
        groups: AttentionGroups | None = None,
    ) -> tuple[jax.Array, SparseKVCache | None, jax.Array | None]:
        """One attention layer.

        Args:
          x: ``[batch, seq, hidden]``.
          positions: ``[batch, seq]`` absolute positions, ``-1`` for padding tokens.
          rope: ``(cos, sin)`` of `rope_cos_sin` at `positions`.
          cache: the cache to write and read, or None for the cache-free pass
            (then token ``t`` of each row must be at position ``t`` or padding).
          page_table: ``[batch, max_pages]`` page ids (with a cache).
          precision: pool dtypes and scale.
          groups: for a ragged step (``[T, 1]`` tokens with a cache), how attention
            groups the tokens (`jax_sparse_kv.ops.ragged.AttentionGroups`); the
            cache is written through `page_table` (one row per token) either way.

        Returns:
          ``(out [batch, seq, hidden], cache, selected)``; ``selected`` is
          ``[batch, seq, index_n_heads, index_topk_blocks]`` block ids for sparse
          layers (``-1`` = none), else None.
        """
        c = self.config
        b, s, _ = x.shape
        cos, sin = rope
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(b, s, c.num_attention_heads, c.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(b, s, c.num_key_value_heads, c.head_dim)), cos, sin)
        v = self.v_proj(x).reshape(b, s, c.num_key_value_heads, c.head_dim)
        iq = ik = iv = None
        if self.sparse:
            idx = self.indexer
            r = min(cos.shape[-1], c.index_head_dim)  # the reference slices cos/sin to the index width
            iq = idx.q_norm(idx.q_proj(x).reshape(b, s, c.index_n_heads, c.index_head_dim))
            ik = idx.k_norm(idx.k_proj(x).reshape(b, s, 1, c.index_head_dim))
            iq, ik = apply_rope(iq, cos[..., :r], sin[..., :r]), apply_rope(ik, cos[..., :r], sin[..., :r])
            if self.index_value:
                iv = idx.v_proj(x).reshape(b, s, 1, c.index_head_dim)

        if cache is None:  # attend over this call's own K/V, rounded as the pools would store them
            fresh = {"k": k, "v": v, "ik": ik, "iv": iv}
            src = {
                name: ops.ContiguousKV(precision.round_trip(t, index=name.startswith("i")))
                for name, t in fresh.items()
                if t is not None
            }
        else:
            cache, src = self._write_and_read(cache, page_table, positions, k, v, ik, iv, precision)

        if groups is None:
            out, index_out, selected = self._attend(q, iq, positions, src)
        else:  # a ragged step: decode rows alone, prefill chunks in query blocks, back onto the flat tokens
            flat = lambda t: None if t is None else t.reshape((b * s,) + t.shape[2:])  # noqa: E731
            parts: list[list] = [[], [], []]
            for index, table in groups.groups():
                if index.shape[0] == 0:  # no rows of this kind in this program
                    continue
                srcs = {name: dataclasses.replace(kv, page_table=table) for name, kv in src.items()}
                pos = groups.gather(flat(positions), index, -1)
                iq_g = None if iq is None else groups.gather(flat(iq), index)
                for part, r in zip(parts, self._attend(groups.gather(flat(q), index), iq_g, pos, srcs), strict=True):
                    part.append(r)
            out, index_out, selected = (
                None if part[0] is None else groups.scatter(part, b * s).reshape((b, s) + part[0].shape[2:])
                for part in parts
            )
        out = self.o_proj(out.reshape(b, s, c.num_attention_heads * c.head_dim).astype(x.dtype))
        if index_out is not None:
            out = out + self.indexer.o_proj(index_out.reshape(b, s, -1).astype(x.dtype))
        return out, cache, selected

    def _attend(self, q, iq, positions, src):
        """Attention of queries ``[b, s, heads, dim]`` over `src`: ``(out, index attention out or None, selected)``."""
        c = self.config
        selected = index_out = None
        if self.sparse:
            scores = ops.block_scores(iq, src["ik"], positions, c.index_block_size)
            selected = ops.select_blocks(
                scores,
                positions,
                c.index_block_size,
                c.index_topk_blocks,
                init_blocks=0,
                local_blocks=c.index_local_blocks,
            )
            per_kv = selected
            if c.num_key_value_heads > c.index_n_heads:  # each KV head's query group lies in one index head's
                per_kv = jnp.repeat(selected, c.num_key_value_heads // c.index_n_heads, axis=2)
            # a decode step (one token per sequence, from the cache) runs the Pallas kernel on GPU/TPU
            out = ops.block_sparse_attention(q, src["k"], src["v"], positions, per_kv, c.index_block_size)
        else:
            out = ops.dense_attention(q, src["k"], src["v"], positions)
        if self.index_value:
            index_out = ops.dense_attention(iq, src["ik"], src["iv"], positions)
        return out, index_out, selected

    def _write_and_read(self, cache, page_table, positions, k, v, ik, iv, precision):
        """Writes this step's rows at their slots, then returns paged sources of the whole layer."""
        page_size = cache.layout.page_size
        b, s = positions.shape
        loc = token_slots(page_table, positions, page_size).reshape(b * s)

        def rows(t):  # [b, s, heads, dim] -> [b * s, heads, dim], the cache's token-major order
            return None if t is None else t.reshape((b * s,) + t.shape[2:])

        def paged(buf, index=False):
            return ops.PagedKV(buf, page_table, page_size, precision.read_scale(index))

        scale = precision.scale
        if self.sparse:
            cache = cache.set_fused_kv_index_buffer(
                self.layer_id,
                loc,
                rows(k),
                rows(v),
                rows(ik),
                rows(iv),
                scale,
                scale,
                index_k_scale=scale,
                index_v_scale=scale,
            )
        else:
            cache = cache.set_kv_buffer(self.layer_id, loc, rows(k), rows(v), scale, scale)
        key, value = cache.get_kv_buffer(self.layer_id)
        src = {"k": paged(key), "v": paged(value)}
        if self.index_value:
            ikb, ivb = cache.get_index_kv_buffer(self.layer_id)
            src["ik"], src["iv"] = paged(ikb, True), paged(ivb, True)
        elif self.sparse:
            src["ik"] = paged(cache.get_index_k_buffer(self.layer_id), True)
        return cache, src


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, config: MiniMaxM3Config, layer_id: int, *, init: Init):
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, init=init)
        self.self_attn = Attention(config, layer_id, init=init)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, init=init)
        if config.mlp_layer_types[layer_id] == "sparse":
            self.mlp = SparseMoE(config, init=init)
        else:
            self.mlp = DenseMLP(config, config.dense_intermediate_size, init=init)

    def __call__(self, x, positions, rope, cache, page_table, precision, groups=None):
        h, cache, selected = self.self_attn(
            self.input_layernorm(x), positions, rope, cache, page_table, precision, groups
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache, selected


class MiniMaxM3(nnx.Module):
    """MiniMax-M3 text model: embedding, decoder layers, final norm, LM head.

    ``MiniMaxM3(config, seed=0)`` draws random weights (std 0.02, norms zero as
    in transformers); ``seed=None`` gives shapes only; `from_pretrained` loads
    a safetensors checkpoint. The
    layers may cover a pipeline stage only: ``layer_ids`` (absolute ids)
    chooses which are kept; every stage draws all weights from the same seed in
    the same order, so stage models share the weights of one full model.
    """

    def __init__(
        self,
        config: MiniMaxM3Config,
        *,
        seed: int | None = 0,
        dtype: Any = jnp.float32,
        layer_ids: tuple[int, ...] | None = None,
    ):
        init = Init(seed, dtype)
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.layer_ids = c.layer_ids if layer_ids is None else tuple(layer_ids)
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init=init)
        # build every layer so that each layer's weights depend on the seed only, not on the stage
        layers = {i: DecoderLayer(c, i, init=init) for i in c.layer_ids}
        self.layers = nnx.List([layers[i] for i in self.layer_ids])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init=init)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, init=init)
        if c.vision is not None:  # drawn after the text weights: a VL model's text weights equal the text model's
            self.vision_tower = VisionTower(c.vision, init=init)
            self.multi_modal_projector = MultiModalProjector(c.vision, c.hidden_size, init=init)

    @classmethod
    def from_pretrained(cls, path: Any, dtype: Any = None, mesh: Any = None, **kwargs: Any) -> MiniMaxM3:
        """Loads a Hugging Face checkpoint directory; see `jax_sparse_kv.nn.weights.load_pretrained`.

        ``config_overrides=`` (a dict or JSON text) merges into config.json as vLLM's ``--hf-overrides``.
        """
        return load_pretrained(path, dtype=dtype, mesh=mesh, model_cls=cls, **kwargs)

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
        logits_indices: jax.Array | None = None,
        attention_groups: AttentionGroups | None = None,
        images: Any = None,
        image_features: jax.Array | None = None,
        image_index: jax.Array | None = None,
        aux_layer_ids: tuple[int, ...] = (),
    ):
        """Runs the decoder over ``tokens`` and reads/writes the cache.

        Args:
          tokens: ``[batch, seq]`` int token ids (any value for padding).
          positions: ``[batch, seq]`` absolute positions; ``-1`` marks padding.
            Prefill passes ``0..n-1``, a decode step the next position.
          cache: the `SparseKVCache` to write and read; ``None`` runs the
            cache-free pass over ``tokens`` alone (row ``t`` at position ``t``
            or padding).
          page_table: ``[batch, max_pages]`` page ids of each sequence (with a cache).
          kv_scale: scale for casting writes into fp8/bf16 pools.
          precision: for the cache-free pass, the pool dtypes to emulate
            (defaults to f32, or to the cache's dtypes when a cache is given).
          logits_indices: ``[rows]`` indices into the flattened ``batch * seq`` tokens: the LM head
            runs on those tokens only and logits come back as ``[rows, 1, vocab]`` (a serving
            step needs logits of a few tokens, not of every prefill token).
          attention_groups: with a cache and ``[T, 1]`` tokens of a ragged step, how
            attention groups them (`jax_sparse_kv.ops.ragged.AttentionGroups`:
            decode rows alone, prefill chunks in query blocks).
          return_selection: also return ``{layer_id: [batch, seq, index_n_heads, topk]}``,
            the blocks each sparse layer's indexer chose.
          images: an image batch (``pixel_values [patches, patch_dim]``, ``grid_thw [images, 3]``,
            `jax_sparse_kv.multimodal.ImageProcessor`'s output) whose features fill the
            ``image_token_id`` placeholders of ``tokens`` in order (the prompt already expanded,
            `jax_sparse_kv.multimodal.expand_image_tokens`). Runs the vision tower eagerly.
          image_features, image_index: the same, precomputed (what a serving step passes):
            ``image_features [F, hidden]`` and ``image_index [batch, seq]`` int, the row of
            ``image_features`` each token takes instead of its embedding (``-1``: its own embedding).
          aux_layer_ids: layer ids ``k`` (``0..num_hidden_layers``) whose input residual stream (``k =
            num_hidden_layers``: the last layer's output, before the final norm) is also returned, as
            ``aux [batch, seq, len(aux_layer_ids) * hidden]`` concatenated in ascending order (EAGLE3 drafts).

        Returns:
          ``(logits [batch, seq, vocab] f32, cache)``, plus the selections if asked, plus ``aux`` last if
          `aux_layer_ids` is given.
          Under a mesh of `Explicit` axes the model runs on `Auto` axes (see
          `call_on_auto_axes`).
        """
        if images is not None:
            if image_features is not None:
                raise ValueError("pass images or image_features, not both")
            image_features, image_index = self.image_inputs(tokens, images)
        if explicit_mesh(nnx.state(self), tokens, positions, cache, page_table) is not None:
            return call_on_auto_axes(
                self,
                tokens,
                positions,
                cache,
                page_table,
                kv_scale=kv_scale,
                precision=precision,
                return_selection=return_selection,
                logits_indices=logits_indices,
                attention_groups=attention_groups,
                image_features=image_features,
                image_index=image_index,
                aux_layer_ids=aux_layer_ids,
            )
        if cache is not None:
            self.config.check_layout(cache.layout)
            if page_table is None:
                raise ValueError("page_table is required with a cache")
            precision = KVPrecision.of(cache.layout, kv_scale)
        elif precision is None:
            precision = KVPrecision(scale=kv_scale)
        x = self.embed(tokens)
        if image_features is not None:
            if image_index is None:
                raise ValueError("image_features needs image_index ([batch, seq], -1 for text tokens)")
            take = image_index[..., None] >= 0
            x = jnp.where(take, image_features.astype(x.dtype)[jnp.maximum(image_index, 0)], x)
        x, cache, selections = self.forward_layers(
            x, positions, cache, page_table, precision, attention_groups, aux_layer_ids=aux_layer_ids
        )
        if aux_layer_ids:
            x, aux = x
        if logits_indices is not None:
            x = x.reshape(-1, x.shape[-1])[logits_indices][:, None]
        logits = self.head(x)
        out = (logits, cache, selections) if return_selection else (logits, cache)
        return (*out, aux) if aux_layer_ids else out

    def weight_bytes(self) -> int:
        """Bytes the parameters take in device memory, all shards together (a replicated parameter counts once).

        Naming, quantizing and counting parameters live in `jax_sparse_kv.nn.params` (``params.hf_params(model)``,
        ``params.quantize_weights(model, quant)``, ...)."""
        return params.weight_bytes(self)

    def embed_images(self, pixel_values: Any, grid_thw: Any) -> list[jax.Array]:
        """The text-width features of each image: a list of ``[t * h * w / merge**2, hidden]``, one per image.

        ``pixel_values [patches, patch_dim]`` and ``grid_thw [images, 3]`` as the image
        processor gives them. All images run in one program (attention stays inside each
        image), padded to `jax_sparse_kv.nn.vision.patch_bucket` patches so that sizes
        share compiled programs (one per bucket: padding and splitting happen on the host).
        """
        v = self.config.vision
        if v is None:
            raise ValueError("this model has no vision tower (a text-only checkpoint: config.vision is None)")
        grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        pixels = np.asarray(pixel_values, np.float32)  # padded on the host: no program per image size
        counts = grid.prod(axis=1)
        if pixels.ndim != 2 or pixels.shape != (int(counts.sum()), v.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixels.shape)}; grid_thw {grid.tolist()} needs "
                f"({int(counts.sum())}, {v.patch_dim})"
            )
        merge = v.spatial_merge_size
        padded = patch_bucket(len(pixels), merge**2)
        positions, segments = vision_inputs(grid, merge, pad_to=padded)
        pixels = np.pad(pixels, ((0, padded - len(pixels)), (0, 0)))
        features = _encode_images(self.vision_tower, self.multi_modal_projector, pixels, positions, segments)
        features = np.asarray(jax.device_get(features))[: int(counts.sum()) // merge**2]
        return [jnp.asarray(f) for f in np.split(features, np.cumsum(counts // merge**2)[:-1])]

    def image_inputs(self, tokens: jax.Array, images: Any) -> tuple[jax.Array, jax.Array]:
        """``(image_features [F, hidden], image_index [batch, seq])`` for ``tokens`` holding the expanded
        placeholders of ``images`` (in order). Raises `ValueError` when the counts differ."""
        v = self.config.vision
        if v is None:
            raise ValueError("this model has no vision tower (a text-only checkpoint: config.vision is None)")
        features = jnp.concatenate(self.embed_images(images.pixel_values, images.grid_thw))
        is_image = jnp.asarray(tokens) == v.image_token_id
        if not isinstance(is_image, jax.core.Tracer):
            n = int(is_image.sum())
            if n != features.shape[0]:
                raise ValueError(
                    f"the prompt holds {n} image tokens (id {v.image_token_id}) but the images give "
                    f"{features.shape[0]} features: expand the prompt with expand_image_tokens"
                )
        flat = is_image.reshape(-1)
        index = jnp.where(flat, jnp.cumsum(flat) - 1, -1).reshape(is_image.shape).astype(jnp.int32)
        return features, index

    def embed(self, tokens: jax.Array) -> jax.Array:
        """``[batch, seq]`` token ids -> ``[batch, seq, hidden]``."""
        return jnp.take(self.embed_tokens.weight[...], tokens, axis=0)

    def forward_layers(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: SparseKVCache | None,
        page_table: jax.Array | None,
        precision: KVPrecision,
        attention_groups: AttentionGroups | None = None,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[Any, SparseKVCache | None, dict[int, jax.Array]]:
        """This model's decoder layers on hidden states ``x [batch, seq, hidden]``.

        A pipeline stage calls this alone: stage ``i`` feeds its output to
        stage ``i + 1``, each with the cache of its own stage layout. With `aux_layer_ids`, the first
        result is ``(x, aux [batch, seq, len(aux_layer_ids) * hidden])``: the residual stream entering each
        listed layer (``num_hidden_layers``: the output of the last), in ascending order.
        """
        c = self.config
        rope = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, c.rope_scaling)
        selections = {}
        wanted = sorted(set(aux_layer_ids))
        aux = {}
        for layer in self.layers:
            if layer.layer_id in wanted:
                aux[layer.layer_id] = x
            x, cache, selected = layer(x, positions, rope, cache, page_table, precision, attention_groups)
            if selected is not None:
                selections[layer.layer_id] = selected
        if c.num_hidden_layers in wanted:
            aux[c.num_hidden_layers] = x
        if not wanted:
            return x, cache, selections
        missing = [k for k in wanted if k not in aux]
        if missing:
            raise ValueError(f"aux_layer_ids {missing} are not layers of this model (stage layers {self.layer_ids})")
        return (x, jnp.concatenate([aux[k] for k in wanted], axis=-1)), cache, selections

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: ``[batch, seq, hidden] -> [batch, seq, vocab]`` f32."""
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return jnp.einsum("bsh,vh->bsv", x, self.embed_tokens.weight[...]).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)


def _encode_images(tower: VisionTower, projector: MultiModalProjector, pixels, positions, segments) -> jax.Array:
    """Vision tower + projector on one padded batch of patches: ``[P, patch_dim] -> [P / merge**2, hidden]``."""
    graphdef, state = nnx.split((tower, projector))
    return _encode_split(graphdef, state, pixels, positions, segments)


@functools.partial(jax.jit, static_argnums=0)  # jax.jit, not nnx.jit: flax 0.12.1 (the floor) passes jax 0.10 an
def _encode_split(graphdef, state, pixels, positions, segments) -> jax.Array:  # argument it no longer takes
    tower, projector = nnx.merge(graphdef, state)
    return projector(tower(pixels, positions, segments))


def call_on_auto_axes(model: MiniMaxM3, tokens, positions, cache=None, page_table=None, **kwargs):
    """``model(tokens, positions, cache, page_table, **kwargs)`` with the mesh's `Explicit` axes `Auto` inside.

    What `MiniMaxM3.__call__` does when its parameters or inputs are typed with
    a mesh of `Explicit` axes (`jax.make_mesh`): the model is written for
    GSPMD (e.g. the output projection contracts over heads split on the mesh,
    whose result sharding `Explicit` axes leave ambiguous). Logits and
    selections come back replicated, the cache with the shardings it came in
    with, so a donated cache aliases and the next call reuses the program.
    """
    graphdef, state = nnx.split(model)

    def run(state, tokens, positions, cache, page_table):
        return nnx.merge(graphdef, state)(tokens, positions, cache, page_table, **kwargs)

    cache_specs = jax.tree.map(spec_of, cache)
    rep = jax.sharding.PartitionSpec()
    out_specs = (rep, cache_specs) + ((rep,) if kwargs.get("return_selection") else ())
    out_specs += (rep,) if kwargs.get("aux_layer_ids") else ()
    return on_auto_axes(run, (state, tokens, positions, cache, page_table), out_specs)
