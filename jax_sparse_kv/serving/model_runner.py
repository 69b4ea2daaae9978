"""The jitted ragged step: a scheduler plan's tokens through the model and the sampler, cache donated.

One program per bucket ``(tokens, seqs)``: the plan's tokens are flattened
(ragged, `jax_sparse_kv.ops.ragged`) and padded to a power-of-two token count,
its sequences to a power-of-two sequence count, so the number of programs is
bounded and `warmup` can compile them all up front. The LM head and the sampler
run only on the rows that choose a token (each sampled sequence's last token,
and its draft tokens when speculating), not on every token of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jax_sparse_kv.cache import SparseKVCache, cache_shardings
from jax_sparse_kv.layout import SparseKVLayout
from jax_sparse_kv.nn.decode import keep_cache_shardings
from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.ops.ragged import AttentionGroups, ragged_token_rows
from jax_sparse_kv.platform import head_parallel
from jax_sparse_kv.serving.sampler import BIAS_SLOTS, Penalties, SamplingRows, count_tokens, sample
from jax_sparse_kv.serving.structured import fill_bitmasks
from jax_sparse_kv.sharding import resolve_head_axis

__all__ = ["ModelRunner", "StepInputs", "StepResult", "StepShapes", "buckets", "stack_inputs"]


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    out, b = [], max(1, smallest)
    while b < largest:
        out.append(b)
        b *= 2
    return (*out, largest)


def bucket_of(n: int, sizes: Sequence[int]) -> int:
    for b in sizes:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class StepInputs:
    """Host arrays of one step, already padded to a bucket.

    ``tokens [T]``; ``cu_q_lens [S + 1]``, ``kv_lens [S]``, ``page_indices [S, W]``
    (ragged metadata); ``sample_rows [R]`` flattened token index of each row that
    chooses a token, with its `SamplingRows`.
    """

    tokens: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    sample_rows: np.ndarray
    sampling: SamplingRows
    decode: np.ndarray  # [D, R] tokens of each decode row (T = none), D and R from `StepShapes.group_shapes`
    decode_seq: np.ndarray  # [D] its sequence
    blocks: np.ndarray  # [B, Q] query blocks of consecutive tokens of one sequence (T = none)
    block_seq: np.ndarray  # [B] the sequence of each block
    image_features: np.ndarray | None = None  # [F, hidden] features of the image placeholders in this step
    image_index: np.ndarray | None = None  # [T] the row of image_features each token takes (-1: its embedding)
    penalized: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # (row, request) with penalties
    prev_index: np.ndarray | None = None  # [T] the row of the previous step's tokens a token takes (-1: its own)


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The static shapes of an engine's steps: buckets, sample rows per sequence, page-table widths.

    A step's page tables are as wide as its longest scheduled sequence needs, rounded up to a power-of-two
    multiple of ``min_table_width`` (`table_buckets`), at most ``table_width`` (the widest a sequence can be):
    what attention and the indexer scan follows the live context of the step, not the engine's limits.

    Attention groups a step's tokens (`jax_sparse_kv.ops.ragged.AttentionGroups`): a sequence with at most
    ``row_tokens`` new tokens attends as one decode row (each query through the cache up to its own position;
    a step's rows are as wide as its longest such sequence, rounded up to one of `row_buckets`), the others in
    query blocks of ``query_block`` consecutive tokens. ``row_tokens > 1``
    makes a speculative verification (``1 + drafts`` tokens) a decode row: what a CPU runs fastest (measured
    with the demo model, 4 sequences of 4 drafts: 3.6 ms a step, against 6.5 ms with a row per token and
    8.0 ms in blocks of 16: the row's dense attention and index scores read its pages once, its sparse
    attention takes each query's own blocks), while a GPU's or TPU's query-block kernel reads a block's pages
    once for all its queries.
    """

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    rows_per_seq: int
    table_width: int
    query_block: int = 32
    min_table_width: int = 16
    row_tokens: int = 1

    @property
    def table_buckets(self) -> tuple[int, ...]:
        """Page-table widths a step may have: ``min_table_width * 2**i`` below ``table_width``, then it."""
        return buckets(min(self.min_table_width, self.table_width), self.table_width)

    def inputs(
        self,
        seqs: Sequence[Any],
        greedy: bool = False,
        eos: Sequence[int] = (),
        image_features: Callable[[Any], np.ndarray] | None = None,
        sizes: tuple[int, int, int, bool, int] | None = None,
    ) -> tuple[StepInputs, list[int]]:
        """Ragged, bucketed host arrays of scheduled sequences, and each sequence's first sample row.

        A sequence (`jax_sparse_kv.serving.scheduler.ScheduledSeq`) contributes its
        tokens ``request.tokens[start : start + num_new]`` and its drafts; when it
        samples, its last real token and each draft get a row. `greedy` makes
        every row greedy (a draft model drafting). `eos`: the model's EOS ids, held back
        (with the request's stop ids) from a row whose request has not reached ``min_tokens``.
        `image_features(span)`: the ``[length, hidden]`` features of an `ImageSpan`; with it, the step
        carries the rows of the image placeholders it computes (a chunk that cuts an image takes its
        part of the rows), padded to a token bucket. `sizes`: the step's `sizes` (default: those of `seqs`).
        """
        num_tokens, num_seqs, width, rows_only, per_row = self.sizes(seqs) if sizes is None else sizes
        num_rows = num_seqs * self.rows_per_seq
        tokens = np.zeros(num_tokens, np.int32)
        cu = np.zeros(num_seqs + 1, np.int32)
        kv_lens = np.zeros(num_seqs, np.int32)
        table = np.zeros((num_seqs, width), np.int32)
        sample_rows = np.zeros(num_rows, np.int32)
        names = ("temperature", "top_k", "top_p", "min_p", "seed", "position", "logprobs", "draft")
        cols = {k: np.zeros(num_rows) for k in names}
        cols["top_p"][:] = 1.0
        cols["logprobs"][:] = -1
        cols["draft"][:] = -1
        biased: dict[int, dict[int, float]] = {}  # row -> its bias entries (logit_bias, min_tokens' -inf)
        penalized: list[tuple[int, Any]] = []  # (row, request) of rows with presence/frequency/repetition penalties
        constrained: list[tuple[Any, int]] = []  # (matcher, row) of rows a grammar constrains
        image_rows: list[np.ndarray] = []
        image_index = np.full(num_tokens, -1, np.int32)
        firsts, row, offset, num_image_rows = [], 0, 0, 0
        prev_index = np.full(num_tokens, -1, np.int32)
        for s, seq in enumerate(seqs):
            req = seq.request
            end, known = seq.start + seq.num_new, req.num_tokens
            new = req.token_slice(seq.start, min(end, known)) + [0] * (end - known) + list(seq.drafts)
            if end > known:  # the last token was sampled by the step before, still on the device: read there
                prev_index[offset + known - seq.start] = req.last_row
            if image_features is not None:
                for span in req.images:  # the part of each image this chunk computes
                    lo, hi = max(span.start, seq.start), min(span.end, seq.start + seq.num_new)
                    if lo < hi:
                        image_rows.append(image_features(span)[lo - span.start : hi - span.start])
                        at = offset + lo - seq.start
                        image_index[at : at + hi - lo] = np.arange(num_image_rows, num_image_rows + hi - lo)
                        num_image_rows += hi - lo
            tokens[offset : offset + len(new)] = new
            offset += len(new)
            cu[s + 1] = offset
            kv_lens[s] = seq.start + len(new)
            table[s, : len(req.pages)] = req.page_array()
            firsts.append(row)
            if seq.sample:
                p = req.params
                for j in range(1 + len(seq.drafts)):  # the last real token, then each draft
                    sample_rows[row] = offset - len(seq.drafts) - 1 + j
                    values = dict(
                        temperature=0.0 if greedy else p.temperature,
                        top_k=p.top_k,
                        top_p=p.top_p,
                        min_p=p.min_p,
                        seed=req.seed,
                        position=end + j,
                        logprobs=-1 if greedy or p.logprobs is None else p.logprobs,
                        draft=seq.drafts[j] if j < len(seq.drafts) else -1,
                    )
                    for name, value in values.items():
                        cols[name][row] = value
                    if not greedy and req.constrained:  # structured outputs: the grammar's allowed tokens
                        constrained.append((req.matcher, row))
                    if not greedy:  # (a draft model drafting proposes without biases: the target checks them)
                        entries = dict(p.logit_bias or {})
                        if end + j - len(req.prompt) < p.min_tokens:  # a stop token here would end it too soon
                            held = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos))
                            entries.update(dict.fromkeys(held, -np.inf))
                        if entries:
                            biased[row] = entries
                        if p.penalized:
                            penalized.append((row, req))
                    row += 1
        cu[len(seqs) + 1 :] = offset
        decode, decode_seq, blocks, block_seq = self._groups(seqs, cu, num_tokens, num_seqs, rows_only, per_row)
        if biased:
            cols["bias_ids"] = np.full((num_rows, BIAS_SLOTS), np.iinfo(np.int32).max, np.int32)  # no entry
            cols["bias"] = np.zeros((num_rows, BIAS_SLOTS), np.float32)
            for r, entries in biased.items():
                cols["bias_ids"][r, : len(entries)] = list(entries)
                cols["bias"][r, : len(entries)] = list(entries.values())
        if constrained:
            cols["bitmask"] = np.full((num_rows, constrained[0][0].words), -1, np.int32)  # all ones: all allowed
            fill_bitmasks(constrained, cols["bitmask"])
        sampling = SamplingRows.from_numpy(**cols)
        inputs = StepInputs(
            tokens,
            cu,
            kv_lens,
            table,
            sample_rows,
            sampling,
            decode,
            decode_seq,
            blocks,
            block_seq,
            prev_index=prev_index,
        )
        inputs.penalized = penalized
        if image_rows:
            rows = np.concatenate(image_rows)
            padded = np.zeros((bucket_of(len(rows), self.token_buckets), rows.shape[1]), rows.dtype)
            padded[: len(rows)] = rows
            inputs.image_features, inputs.image_index = padded, image_index
        return inputs, firsts

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Queries per decode row a step may have: powers of two below ``row_tokens``, then it (``(1,)`` when
        ``row_tokens`` is 1). A step's rows are as wide as its longest row sequence needs, so a decode step of
        an engine that speculates costs what a plain engine's does, and a verification of one draft a row of 2."""
        return buckets(1, self.row_tokens)

    def group_shapes(
        self, num_tokens: int, num_seqs: int, rows_only: bool = False, per_row: int | None = None
    ) -> tuple[int, int, int, int]:
        """``(query block size Q, number of blocks B, decode rows D, queries per decode row R)`` of a bucket:
        every chunk fits whole blocks, every sequence of at most ``R`` tokens fits a row (`per_row`, one of
        `row_buckets`; default ``row_tokens``).

        A step whose sequences all run at most ``row_tokens`` tokens (decodes; verifications when
        ``row_tokens > 1``) has no blocks: its program has no query-block attention at all.
        """
        q = min(self.query_block, num_tokens)
        return q, 0 if rows_only else -(-num_tokens // q) + num_seqs, num_seqs, per_row or self.row_tokens

    def programs(self) -> list[tuple[int, int, bool, int, int]]:
        """Every ``(tokens, seqs, rows_only, queries per decode row, table width)`` program a step may need
        (what `Engine.warmup` compiles)."""
        out = [(t, s, False) for t in self.token_buckets for s in self.seq_buckets if s <= t]
        # a rows-only step runs at most row_tokens per sequence: at most min(max_seqs * row_tokens,
        # max_tokens_per_step) tokens
        most = bucket_of(min(self.seq_buckets[-1] * self.row_tokens, self.token_buckets[-1]), self.token_buckets)
        out += [(t, s, True) for t, s, _ in out if t <= most]
        return [(t, s, d, r, w) for w in self.table_buckets for t, s, d in out for r in self.row_buckets if r <= t]

    def sizes(self, seqs: Sequence[Any]) -> tuple[int, int, int, bool, int]:
        """The bucketed shapes of a step of `seqs`: ``(tokens, sequences, page-table width, rows only, queries
        per decode row)`` (see `programs`)."""
        lens = [s.num_tokens for s in seqs]
        num_tokens = bucket_of(sum(lens), self.token_buckets)
        num_seqs = bucket_of(len(seqs), self.seq_buckets)
        width = bucket_of(max((len(seq.request.pages) for seq in seqs), default=1), self.table_buckets)
        return num_tokens, num_seqs, width, *self._row_shape(lens)

    def _row_shape(self, lens: Sequence[int]) -> tuple[bool, int]:
        """``(rows only, queries per decode row)`` of a step whose sequences run `lens` tokens each: whether all
        fit a decode row, and the row width its longest such sequence needs (one of `row_buckets`)."""
        longest = max((n for n in lens if n <= self.row_tokens), default=1)
        return all(n <= self.row_tokens for n in lens), bucket_of(max(1, longest), self.row_buckets)

    def group_inputs(
        self,
        groups: Sequence[Sequence[Any]],
        greedy: bool = False,
        eos: Sequence[int] = (),
        image_features: Callable[[Any], np.ndarray] | None = None,
    ) -> tuple[StepInputs, list[list[int]]]:
        """`inputs` of each data-parallel group's sequences at one common program shape, stacked group-major
        (`stack_inputs`), and each group's first sample rows as rows of the stacked step (group ``g``'s rows
        are ``g * rows .. (g + 1) * rows - 1``)."""
        each = [self.sizes(seqs) for seqs in groups]
        common = (
            max(e[0] for e in each),
            max(e[1] for e in each),
            max(e[2] for e in each),
            all(e[3] for e in each),
            max(e[4] for e in each),
        )
        rows = common[1] * self.rows_per_seq
        parts, firsts = [], []
        for g, seqs in enumerate(groups):
            inputs, first = self.inputs(seqs, greedy, eos, image_features, sizes=common)
            inputs.penalized = [(g * rows + r, req) for r, req in inputs.penalized]
            parts.append(inputs)
            firsts.append([g * rows + r for r in first])
        return stack_inputs(parts), firsts

    def _groups(self, seqs, cu, num_tokens, num_seqs, rows_only=None, per_row=None):
        """Decode rows (the tokens of a sequence with at most ``row_tokens``) and query blocks (the rest), as
        token indices; `rows_only` / `per_row` as the step's `sizes` (default: from these sequences' spans)."""
        spans = [(int(cu[s]), int(cu[s + 1])) for s in range(len(seqs))]
        if rows_only is None:
            rows_only, per_row = self._row_shape([end - start for start, end in spans])
        q, num_blocks, num_rows, per_row = self.group_shapes(num_tokens, num_seqs, rows_only, per_row)
        decode = np.full((num_rows, per_row), num_tokens, np.int32)
        decode_seq = np.zeros(num_rows, np.int32)
        blocks = np.full((num_blocks, q), num_tokens, np.int32)
        block_seq = np.zeros(num_blocks, np.int32)
        d = b = 0
        for s, (start, end) in enumerate(spans):
            if end - start <= self.row_tokens:
                decode[d, : end - start] = np.arange(start, end)
                decode_seq[d] = s
                d += 1
                continue
            for first in range(start, end, q):
                n = min(q, end - first)
                blocks[b, :n] = np.arange(first, first + n)
                block_seq[b] = s
                b += 1
        return decode, decode_seq, blocks, block_seq


def stack_inputs(parts: Sequence[StepInputs]) -> StepInputs:
    """Steps of equal program shape, one per data-parallel group, as one step of group-major arrays.

    Every array is concatenated on its first axis: group ``g``'s tokens, sequences, sample rows, decode rows
    and query blocks are the ``g``-th equal slice of each (indices stay local to the group: the step runs per
    group). Sampling columns one group lacks (biases, grammar masks) get their neutral values; image features
    are padded to the largest group's rows. ``prev_index`` already holds rows of the stacked step before.
    """
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    sampling = [p.sampling for p in parts]
    columns = {}
    for field in dataclasses.fields(SamplingRows):
        arrays = [np.asarray(getattr(rows, field.name)) for rows in sampling]
        if arrays[0].ndim == 2:  # [rows, K]: K is 0 in a group without any entry
            width = max(a.shape[1] for a in arrays)
            fill = {"bias_ids": np.iinfo(np.int32).max, "bias": 0, "bitmask": -1}[field.name]
            arrays = [a if a.shape[1] == width else np.full((a.shape[0], width), fill, a.dtype) for a in arrays]
        columns[field.name] = np.concatenate(arrays)
    out = StepInputs(
        cat("tokens"),
        cat("cu_q_lens"),
        cat("kv_lens"),
        cat("page_indices"),
        cat("sample_rows"),
        SamplingRows(**columns),
        cat("decode"),
        cat("decode_seq"),
        cat("blocks"),
        cat("block_seq"),
        prev_index=None if parts[0].prev_index is None else cat("prev_index"),
    )
    out.penalized = [entry for p in parts for entry in p.penalized]
    with_images = [p for p in parts if p.image_features is not None]
    if with_images:
        rows = max(len(p.image_features) for p in with_images)
        hidden, dtype = with_images[0].image_features.shape[1], with_images[0].image_features.dtype
        features, index = [], []
        for p in parts:
            f = np.zeros((rows, hidden), dtype)
            if p.image_features is not None:
                f[: len(p.image_features)] = p.image_features
            features.append(f)
            index.append(np.full(p.tokens.shape, -1, np.int32) if p.image_index is None else p.image_index)
        out.image_features, out.image_index = np.concatenate(features), np.concatenate(index)
    return out


@dataclasses.dataclass
class StepResult:
    """Per row: chosen token, its logprob, the most likely tokens and their logprobs (NumPy)."""

    tokens: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    # speculation: per row, whether its draft is accepted, the token it emits instead (-1: none), and the
    # model's logprobs of both (`jax_sparse_kv.serving.sampler.verify_drafts`)
    accept: np.ndarray | None = None
    residual: np.ndarray | None = None
    draft_logprob: np.ndarray | None = None
    residual_logprob: np.ndarray | None = None


class ModelRunner:
    """Owns the device state (parameters, cache) and the jitted step."""

    def __init__(
        self,
        model: MiniMaxM3,
        layout: SparseKVLayout,
        *,
        kv_scale: float,
        num_logprobs: int,
        mesh: Any = None,
        return_probs: bool = False,
        penalty_slots: int = 0,
        max_rows: int,
        aux_layer_ids: tuple[int, ...] = (),
        data_parallel_axis: str | None = None,
    ):
        """`penalty_slots`: requests with penalties at once (the engine's ``max_seqs``); their token counts
        take ``(penalty_slots + 1) * vocab * 5`` bytes of device memory, allocated when the first comes.
        `max_rows`: the most sample rows a step has (``max_seqs * rows_per_seq``).
        `aux_layer_ids` (an EAGLE3 draft's): each step also keeps, on the device, the residual stream entering
        those target layers for every token it computes, ``last_aux [T, len(ids) * hidden]`` (the same
        forward, no second one); empty (the default): nothing more is computed or kept.
        `data_parallel_axis` (an axis of `mesh`): data-parallel attention. Each group of devices along it runs
        its own sequences over its own shard of the pools (`layout` is all groups' pools: the rows split over
        the axis, each group's first page its padding page): the model runs per group (`jax.shard_map`, manual
        over that axis only; heads and experts stay GSPMD-partitioned within a group, MoE layers exchange tokens
        between groups), and the step's inputs are the groups' own stacked (`StepShapes.group_inputs`);
        sampling runs over all groups' rows at once. `max_rows` counts every group's rows."""
        model.config.check_layout(layout)
        self.layout = layout
        self.mesh = mesh
        self.data_parallel_axis = data_parallel_axis
        self.groups = 1 if data_parallel_axis is None else mesh.shape[data_parallel_axis]
        self.cache = SparseKVCache.zeros(
            layout, sharding=None if mesh is None else cache_shardings(layout, mesh, page_axis=data_parallel_axis)
        )
        graphdef, self.params = nnx.split(model)
        self.aux_layer_ids = tuple(sorted(set(aux_layer_ids)))
        self.last_aux: jax.Array | None = None
        aux_ids = self.aux_layer_ids
        axis = None if mesh is None else resolve_head_axis(mesh)

        def forward(params, cache, tokens, cu_q_lens, kv_lens, page_indices, sample_rows, grouping, images, aux_ids):
            """The model over one step's (one group's) ragged tokens: ``(logits [R, vocab], cache, aux or None)``."""
            model = nnx.merge(graphdef, params)
            features, index = (None, None) if images is None else (images[0], images[1][:, None])
            _, positions, table = ragged_token_rows(cu_q_lens, kv_lens, page_indices, tokens.shape[0])
            decode, decode_seq, blocks, block_seq = grouping
            groups = AttentionGroups(decode, page_indices[decode_seq], blocks, page_indices[block_seq])
            # head-parallel kernels (shard_map over the heads) only where no group axis is manual already
            with contextlib.nullcontext() if mesh is None else head_parallel(mesh, axis):
                # the LM head runs only on the rows that choose a token: [R, 1, vocab]
                got = model(
                    tokens[:, None],
                    positions[:, None],
                    cache,
                    table,
                    kv_scale=kv_scale,
                    logits_indices=sample_rows,
                    attention_groups=groups,
                    image_features=features,
                    image_index=index,
                    aux_layer_ids=aux_ids,
                )
            return got[0][:, 0], got[1], got[2][:, 0] if len(got) > 2 else None  # aux: [T, len(aux_ids) * hidden]

        def model_and_sample(
            params,
            cache,
            tokens,
            cu_q_lens,
            kv_lens,
            page_indices,
            sample_rows,
            grouping,
            images,
            sampling,
            penalties,
            aux_ids,
        ):
            """The model, then the sampler on its rows: ``(sampled, cache, aux)`` (penalty counts read only)."""
            logits, cache, aux = forward(
                params, cache, tokens, cu_q_lens, kv_lens, page_indices, sample_rows, grouping, images, aux_ids
            )
            return sample(logits, sampling, num_logprobs, return_probs, penalties=penalties), cache, aux

        if data_parallel_axis is not None:  # each group its own tokens, pages and rows (logits never leave it)
            model_and_sample = _per_group(model_and_sample, mesh, data_parallel_axis, layout, self.params)
        replicated = None if data_parallel_axis is None else NamedSharding(mesh, PartitionSpec())

        def step(
            params,
            cache,
            tokens,
            cu_q_lens,
            kv_lens,
            page_indices,
            sample_rows,
            sampling,
            grouping,
            images,
            penalty_state,
            penalty_rows,
            prev=None,
        ):
            if prev is not None:  # async scheduling: tokens the step before sampled, read on the device
                prev_tokens, prev_index = prev
                tokens = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], tokens)
            penalties = None if penalty_state is None else Penalties(*penalty_state, *penalty_rows)
            out, cache, aux = model_and_sample(
                params,
                cache,
                tokens,
                cu_q_lens,
                kv_lens,
                page_indices,
                sample_rows,
                grouping,
                images,
                sampling,
                penalties,
                aux_ids if prev is not None else (),
            )
            if mesh is not None:
                cache = keep_cache_shardings(cache, mesh, page_axis=data_parallel_axis)
            if replicated is not None:  # every process reads every group's rows; one program whatever GSPMD picked
                out = jax.lax.with_sharding_constraint(out, replicated)
            state = None if penalties is None else (count_tokens(penalties, out[0]), penalties.prompt)
            if replicated is not None:
                state = jax.lax.with_sharding_constraint(state, replicated)
            if prev is None:
                return out, cache, state, None, aux
            following = prev[0].at[: out[0].shape[0]].set(out[0])  # the next step's prev_tokens
            if replicated is not None:
                following = jax.lax.with_sharding_constraint(following, replicated)
            return out, cache, state, following, aux

        self._fn = jax.jit(step, donate_argnums=(1, 10))

        def drafts(
            params,
            cache,
            tokens,
            cu_q_lens,
            kv_lens,
            page_indices,
            sample_rows,
            sampling,
            grouping,
            seq_rows,
            counts,
            greedy,
            num_steps,
        ):
            """Greedy drafting: the first step, then ``num_steps - 1`` steps of one token per sequence (its last
            draft; `greedy`: their sampling rows), in one program: ``([num_steps, S] drafts, -1 past a sequence's
            count), cache``."""
            out, cache, _, _, _ = step(
                params,
                cache,
                tokens,
                cu_q_lens,
                kv_lens,
                page_indices,
                sample_rows,
                sampling,
                grouping,
                None,
                None,
                None,
            )
            num_seqs = kv_lens.shape[0]
            first = out[0][jnp.maximum(seq_rows, 0)]  # [S] each sequence's first draft
            index = jnp.arange(num_seqs, dtype=jnp.int32)
            one_each = (index[:, None], index, jnp.zeros((0, 1), jnp.int32), jnp.zeros(0, jnp.int32))  # rows only
            cu = jnp.arange(num_seqs + 1, dtype=jnp.int32)

            def next_draft(carry, j):  # sequence s feeds its draft j at position kv_lens[s] + j - 1
                cache, last = carry
                active = j < counts  # it wants draft j + 1; the others run as padding (position -1: no write)
                out, cache, _, _, _ = step(
                    params,
                    cache,
                    last,
                    cu,
                    jnp.where(active, kv_lens + j, 0),
                    page_indices,
                    index,
                    greedy,
                    one_each,
                    None,
                    None,
                    None,
                )
                return (cache, jnp.where(active, out[0], last)), jnp.where(active, out[0], -1)

            (cache, _), rest = jax.lax.scan(next_draft, (cache, first), jnp.arange(1, num_steps, dtype=jnp.int32))
            return jnp.concatenate([jnp.where(counts >= 1, first, -1)[None], rest]), cache

        self._drafts = jax.jit(drafts, donate_argnums=(1,), static_argnames=("num_steps",))
        self.vocab_size = model.config.vocab_size
        self.penalty_slots = penalty_slots
        self._penalty_state: tuple[jax.Array, jax.Array] | None = None  # (counts, prompt), made when first needed
        self._slots: dict[str, int] = {}  # request id -> its row of the penalty state
        self.max_rows = max_rows
        self._prev_tokens: jax.Array | None = None  # [max_rows] the tokens the last dispatched step sampled
        self.last_times = (0.0, 0.0)

    @property
    def platform(self) -> str:
        """The platform the step runs on (``"cpu"``, ``"gpu"``, ``"tpu"``: its cache's devices')."""
        return next(iter(jax.tree.leaves(self.cache)[0].devices())).platform

    @property
    def compilations(self) -> int:
        """Programs the step has compiled so far (one per bucket used)."""
        return self._fn._cache_size()

    def run(self, inputs: StepInputs) -> StepResult:
        """Runs a step; ``last_times`` is then ``(dispatch, wait)``: seconds to hand the inputs and the program
        to the device (transfers included), and seconds waiting for its results to come back."""
        t0 = time.perf_counter()
        handle = self.dispatch(inputs)
        dispatch = time.perf_counter() - t0
        result = self.fetch(handle)
        self.last_times = (dispatch, self.last_times[1])
        return result

    def dispatch(self, inputs: StepInputs) -> Any:
        """Hands a step to the device and returns at once (JAX dispatches asynchronously): a handle for
        `fetch`. Tokens a step takes from the step before (``inputs.prev_index``) are read from that step's
        output on the device, so a step may be dispatched before the one before it has been fetched."""
        state = rows = None
        if inputs.penalized:  # per row: its count row (0: none) and its penalties (neutral without)
            n = len(inputs.sample_rows)
            slots, presence, frequency = np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.float32)
            repetition = np.ones(n, np.float32)
            for row, req in inputs.penalized:
                p = req.params
                slots[row] = self._penalty_slot(req)
                presence[row], frequency[row], repetition[row] = (
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                )
            state, rows = self._penalty_state, (slots, presence, frequency, repetition)
        prev_index = inputs.prev_index
        if prev_index is None:
            prev_index = np.full(inputs.tokens.shape, -1, np.int32)
        if self._prev_tokens is None:
            self._prev_tokens = _zeros_like_output(self.max_rows, self.mesh)
        out, self.cache, state, self._prev_tokens, self.last_aux = self._fn(
            self.params,
            self.cache,
            inputs.tokens,
            inputs.cu_q_lens,
            inputs.kv_lens,
            inputs.page_indices,
            inputs.sample_rows,
            inputs.sampling,
            (inputs.decode, inputs.decode_seq, inputs.blocks, inputs.block_seq),
            None if inputs.image_features is None else (inputs.image_features, inputs.image_index),
            state,
            rows,
            (self._prev_tokens, prev_index),
        )
        if state is not None:
            self._penalty_state = state
        return out

    def dispatch_drafts(self, inputs: StepInputs, seq_rows: np.ndarray, counts: np.ndarray, num_steps: int) -> Any:
        """Greedy drafting in one jitted call: the step of `inputs` (each drafting sequence's unseen tokens,
        sampling its first draft from sample row ``seq_rows[s]``), then ``num_steps - 1`` decode steps of one
        token per sequence, each feeding the sequence's previous draft. `counts` ``[S]``: drafts each sequence
        wants (0 for padding); a sequence past its count computes nothing. Returns a handle: ``np.asarray`` of it
        is ``[num_steps, S]`` drafts (``-1`` past a count)."""
        drafts, self.cache = self._drafts(
            self.params,
            self.cache,
            inputs.tokens,
            inputs.cu_q_lens,
            inputs.kv_lens,
            inputs.page_indices,
            inputs.sample_rows,
            inputs.sampling,
            (inputs.decode, inputs.decode_seq, inputs.blocks, inputs.block_seq),
            seq_rows,
            counts,
            SamplingRows.from_numpy(*(np.zeros(len(counts)) for _ in range(6))),
            num_steps=num_steps,
        )
        return drafts

    def fetch(self, handle: Any) -> StepResult:
        """Waits for a dispatched step's results; ``last_times[1]`` is then the seconds waited."""
        t0 = time.perf_counter()
        out = jax.device_get(handle)
        self.last_times = (0.0, time.perf_counter() - t0)
        return StepResult(*(np.asarray(o) for o in out))

    def _penalty_slot(self, req: Any) -> int:
        """The row of the penalty state that counts `req`'s tokens; a new one starts from its prompt and output."""
        slot = self._slots.get(req.request_id)
        if slot is not None:
            return slot
        if self._penalty_state is None:
            shape = (self.penalty_slots + 1, self.vocab_size)
            self._penalty_state = (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_))
        free = sorted(set(range(1, self.penalty_slots + 1)) - set(self._slots.values()))
        if not free:
            raise RuntimeError(f"more than {self.penalty_slots} requests with penalties at once")
        slot = self._slots[req.request_id] = free[0]
        prompt, output = list(req.prompt), list(req.output)
        tokens = np.zeros(max(64, 1 << (len(prompt) + len(output) - 1).bit_length()), np.int32)  # pow-2 bucket
        tokens[: len(prompt) + len(output)] = prompt + output
        self._penalty_state = _start_slot(self._penalty_state, slot, tokens, len(prompt), len(prompt) + len(output))
        return slot

    def release_penalty_slots(self, live: Any) -> None:
        """Frees the penalty rows of requests not in `live` (the running requests' ids: finished, aborted and
        preempted ones lose theirs)."""
        for request_id in [r for r in self._slots if r not in live]:
            del self._slots[request_id]

    def run_empty(
        self,
        shapes: StepShapes,
        num_tokens: int,
        num_seqs: int,
        rows_only: bool = False,
        per_row: int | None = None,
        width: int | None = None,
    ) -> None:
        """Runs (so compiles) a step program (`StepShapes.programs`) on padding only (the cache is unchanged)."""
        width = shapes.table_width if width is None else width
        zeros = np.zeros
        num_rows = num_seqs * shapes.rows_per_seq
        q, num_blocks, num_decode, per_row = shapes.group_shapes(num_tokens, num_seqs, rows_only, per_row)
        sampling = SamplingRows.from_numpy(*(zeros(num_rows) for _ in range(6)))
        inputs = StepInputs(
            zeros(num_tokens, np.int32),
            zeros(num_seqs + 1, np.int32),
            zeros(num_seqs, np.int32),
            zeros((num_seqs, width), np.int32),
            zeros(num_rows, np.int32),
            sampling,
            np.full((num_decode, per_row), num_tokens, np.int32),
            zeros(num_decode, np.int32),
            np.full((num_blocks, q), num_tokens, np.int32),
            zeros(num_blocks, np.int32),
        )
        self.run(stack_inputs([inputs] * self.groups))


def _per_group(forward: Callable, mesh: Any, axis: str, layout: SparseKVLayout, params: Any) -> Callable:
    """`forward` (`ModelRunner`'s model call and sampler) run per data-parallel group: `jax.shard_map` manual over
    `axis` only, so each group sees its own slice of the stacked step arrays and its own shard of the pools, as a
    cache of the group's layout (its rows: its padding page, then its pages), and GSPMD still partitions heads
    and experts over the other axes. Parameters split over `axis` (routed experts over every device) come in
    as each group's share; the rest are replicated over it."""
    groups = mesh.shape[axis]
    local = dataclasses.replace(layout, num_slots=layout.num_rows // groups - layout.page_size)
    group = PartitionSpec(axis)
    param_specs = jax.tree.map(lambda leaf: _group_spec(leaf, axis), params)
    cache_specs = jax.tree.map(lambda _: group, SparseKVCache.abstract(layout))

    def run(params, cache, *arrays):
        *arrays, penalties, aux_ids = arrays

        def body(params, cache, *arrays):
            out, cache, aux = forward(params, dataclasses.replace(cache, layout=local), *arrays, aux_ids)
            return out, dataclasses.replace(cache, layout=layout), aux

        arrays.append(penalties)
        array_specs = jax.tree.map(lambda _: group, tuple(arrays))
        if penalties is not None:  # the count rows are every group's (slots are global): replicated, read only
            array_specs = (
                *array_specs[:-1],
                dataclasses.replace(array_specs[-1], counts=PartitionSpec(), prompt=PartitionSpec()),
            )
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(param_specs, cache_specs, *array_specs),
            out_specs=(group, cache_specs, group if aux_ids else None),
            axis_names={axis},
            check_vma=False,
        )(params, cache, *arrays)

    return run


def _group_spec(leaf: Any, axis: str) -> PartitionSpec:
    """How a parameter enters a per-group program: ``P(axis)`` if its first dimension splits over `axis`
    first (each group's contiguous share), else replicated over the groups."""
    spec = getattr(getattr(leaf, "sharding", None), "spec", None) or ()
    names = [tuple(e) if isinstance(e, tuple) else (e,) for e in spec]
    if names and names[0][0] == axis:
        return PartitionSpec(axis)
    if any(axis in n for n in names):
        raise ValueError(
            f"a parameter sharded {spec} splits over the data-parallel axis {axis!r} other than as "
            "the major axis of its first dimension"
        )
    return PartitionSpec()


def _zeros_like_output(n: int, mesh: Any) -> jax.Array:
    """``[n]`` int32 zeros placed as the step's own outputs are (one program whether or not a step came before)."""
    if mesh is None:
        return jnp.zeros(n, jnp.int32)
    return jax.device_put(np.zeros(n, np.int32), NamedSharding(mesh, PartitionSpec(None)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _start_slot(state, slot, tokens, num_prompt, num_tokens):
    """Penalty row `slot` for a request of ``tokens[:num_prompt]`` prompt and ``tokens[num_prompt:num_tokens]``
    output (``tokens`` padded to a bucket): the output's counts and the prompt's tokens."""
    counts, prompt = state
    index = jnp.arange(tokens.shape[0])
    in_output = (index >= num_prompt) & (index < num_tokens)
    counts = counts.at[slot].set(0).at[slot, tokens].add(in_output.astype(jnp.int32))
    outside = jnp.where(index < num_prompt, tokens, prompt.shape[1])  # past the vocabulary: dropped
    prompt = prompt.at[slot].set(False).at[slot, outside].set(True, mode="drop")
    return counts, prompt
