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
from typing import Any, NamedTuple

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
from jax_sparse_kv.serving.sampler import Penalties, SamplingRows, count_tokens, sample, sampling_rows
from jax_sparse_kv.sharding import resolve_head_axis

__all__ = [
    "ModelRunner",
    "StepInputs",
    "StepProgram",
    "StepResult",
    "StepShapes",
    "TokenLayout",
    "buckets",
    "draft_steps",
    "image_rows",
    "run_step",
    "stack_inputs",
    "token_layout",
]


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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "tokens",
        "cu_q_lens",
        "kv_lens",
        "page_indices",
        "sample_rows",
        "sampling",
        "decode",
        "decode_seq",
        "blocks",
        "block_seq",
        "image_features",
        "image_index",
        "prev_index",
    ],
    meta_fields=[],
    drop_fields=["penalized"],
)
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Arrays of one step, already padded to a bucket: one pytree, what the jitted step (`run_step`) takes.

    ``tokens [T]``; ``cu_q_lens [S + 1]``, ``kv_lens [S]``, ``page_indices [S, W]``
    (ragged metadata); ``sample_rows [R]`` flattened token index of each row that
    chooses a token, with its `SamplingRows`. ``penalized`` is host-only (the requests of the rows with
    penalties, whose count rows `ModelRunner.dispatch` looks up): left out of the pytree.
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


class TokenLayout(NamedTuple):
    """Where a step's scheduled sequences sit in its flat, padded host arrays (`token_layout`)."""

    tokens: np.ndarray  # [T] each sequence's new tokens, then its drafts, back to back
    cu_q_lens: np.ndarray  # [S + 1]
    kv_lens: np.ndarray  # [S]
    page_indices: np.ndarray  # [S, W]
    prev_index: np.ndarray  # [T] the row of the previous step's tokens a token takes (-1: its own)
    sample_rows: np.ndarray  # [R] the token each row that chooses a token reads
    firsts: list[int]  # each sequence's first row


def token_layout(seqs: Sequence[Any], num_tokens: int, num_seqs: int, width: int, num_rows: int) -> TokenLayout:
    """The token layout of scheduled sequences (`jax_sparse_kv.serving.scheduler.ScheduledSeq`) in a step of
    the given bucket sizes. A sequence contributes its tokens ``request.tokens[start : start + num_new]`` and its
    drafts; when it samples, its last real token and each draft get a row. A token the step before sampled,
    still on the device, is read there (``prev_index``: the row it came from, ``Request.last_row``)."""
    tokens = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    table = np.zeros((num_seqs, width), np.int32)
    sample_rows = np.zeros(num_rows, np.int32)
    prev_index = np.full(num_tokens, -1, np.int32)
    firsts, row, offset = [], 0, 0
    for s, seq in enumerate(seqs):
        req = seq.request
        end, known = seq.start + seq.num_new, req.num_tokens
        new = req.token_slice(seq.start, min(end, known)) + [0] * (end - known) + list(seq.drafts)
        if end > known:  # the last token was sampled by the step before, still on the device: read there
            prev_index[offset + known - seq.start] = req.last_row
        tokens[offset : offset + len(new)] = new
        offset += len(new)
        cu[s + 1] = offset
        kv_lens[s] = seq.start + len(new)
        table[s, : len(req.pages)] = req.page_array()
        firsts.append(row)
        if seq.sample:  # the last real token, then each draft
            for j in range(-1 - len(seq.drafts), 0):
                sample_rows[row] = offset + j
                row += 1
    cu[len(seqs) + 1 :] = offset
    return TokenLayout(tokens, cu, kv_lens, table, prev_index, sample_rows, firsts)


def image_rows(
    seqs: Sequence[Any],
    cu_q_lens: np.ndarray,
    num_tokens: int,
    image_features: Callable[[Any], np.ndarray],
    token_buckets: Sequence[int],
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(features [F, hidden], index [T])`` of the image placeholders a step computes (a chunk that cuts an image
    takes its part of the rows), ``F`` padded to a token bucket; ``(None, None)`` when it computes none.
    `image_features(span)`: the ``[length, hidden]`` features of an `ImageSpan`."""
    rows: list[np.ndarray] = []
    index = np.full(num_tokens, -1, np.int32)
    count = 0
    for s, seq in enumerate(seqs):
        for span in seq.request.images:  # the part of each image this chunk computes
            lo, hi = max(span.start, seq.start), min(span.end, seq.start + seq.num_new)
            if lo < hi:
                rows.append(image_features(span)[lo - span.start : hi - span.start])
                at = int(cu_q_lens[s]) + lo - seq.start
                index[at : at + hi - lo] = np.arange(count, count + hi - lo)
                count += hi - lo
    if not rows:
        return None, None
    features = np.concatenate(rows)
    padded = np.zeros((bucket_of(len(features), token_buckets), features.shape[1]), features.dtype)
    padded[: len(features)] = features
    return padded, index


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

    ``decode_programs``: a step of decode rows only gets programs of its own, without query-block attention,
    its rows as wide as its longest sequence needs (`row_buckets`). False: every step runs its bucket's mixed
    program, rows ``row_tokens`` wide (one program per token, sequence and table bucket instead of up to
    ``2 * len(row_buckets)``: less to compile, decode steps doing the blocks' padded work).
    """

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    rows_per_seq: int
    table_width: int
    query_block: int = 32
    min_table_width: int = 16
    row_tokens: int = 1
    decode_programs: bool = True

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
        """Ragged, bucketed host arrays of scheduled sequences, and each sequence's first sample row: their
        `token_layout`, `sampling_rows` (`greedy`: every row greedy, a draft model drafting; `eos`: the model's
        EOS ids, held back before ``min_tokens``), attention grouping and, with `image_features(span)` (the
        ``[length, hidden]`` features of an `ImageSpan`), `image_rows`. `sizes`: the step's `sizes` (default:
        those of `seqs`)."""
        num_tokens, num_seqs, width, rows_only, per_row = self.sizes(seqs) if sizes is None else sizes
        num_rows = num_seqs * self.rows_per_seq
        layout = token_layout(seqs, num_tokens, num_seqs, width, num_rows)
        sampling, penalized = sampling_rows(seqs, layout.firsts, num_rows, greedy, eos)
        grouping = self._groups(seqs, layout.cu_q_lens, num_tokens, num_seqs, rows_only, per_row)
        features, index = (
            (None, None)
            if image_features is None
            else image_rows(seqs, layout.cu_q_lens, num_tokens, image_features, self.token_buckets)
        )
        inputs = StepInputs(
            layout.tokens,
            layout.cu_q_lens,
            layout.kv_lens,
            layout.page_indices,
            layout.sample_rows,
            sampling,
            *grouping,
            image_features=features,
            image_index=index,
            penalized=penalized,
            prev_index=layout.prev_index,
        )
        return inputs, layout.firsts

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
        ``row_tokens > 1``) has no blocks (with ``decode_programs``): its program has no query-block attention.
        """
        q = min(self.query_block, num_tokens)
        return q, 0 if rows_only else -(-num_tokens // q) + num_seqs, num_seqs, per_row or self.row_tokens

    def programs(self) -> list[tuple[int, int, bool, int, int]]:
        """Every ``(tokens, seqs, rows_only, queries per decode row, table width)`` program a step may need
        (what `Engine.warmup` compiles)."""
        out = [(t, s, False) for t in self.token_buckets for s in self.seq_buckets if s <= t]
        if not self.decode_programs:
            return [(t, s, d, self.row_tokens, w) for w in self.table_buckets for t, s, d in out]
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
        fit a decode row, and the row width its longest such sequence needs (one of `row_buckets`); without
        ``decode_programs``: never rows only, rows ``row_tokens`` wide."""
        if not self.decode_programs:
            return False, self.row_tokens
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
            parts.append(dataclasses.replace(inputs, penalized=[(g * rows + r, req) for r, req in inputs.penalized]))
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
    features = index = None
    with_images = [p for p in parts if p.image_features is not None]
    if with_images:
        rows = max(len(p.image_features) for p in with_images)
        hidden, dtype = with_images[0].image_features.shape[1], with_images[0].image_features.dtype
        features = np.zeros((len(parts), rows, hidden), dtype)
        for g, p in enumerate(parts):
            if p.image_features is not None:
                features[g, : len(p.image_features)] = p.image_features
        features = features.reshape(len(parts) * rows, hidden)
        index = np.concatenate(
            [np.full(p.tokens.shape, -1, np.int32) if p.image_index is None else p.image_index for p in parts]
        )
    return StepInputs(
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
        image_features=features,
        image_index=index,
        penalized=[entry for p in parts for entry in p.penalized],
        prev_index=None if parts[0].prev_index is None else cat("prev_index"),
    )


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
        """`penalty_slots`: requests with penalties at once in one group (the engine's ``max_seqs``); their token
        counts take ``penalty_state_bytes(penalty_slots, vocab)`` bytes of each device's memory (under
        data-parallel attention each group's rows live on its own devices), allocated here: every step takes them, so a
        step with penalties runs the program of a step without (the sampler applies them to every row,
        neutral where a row has none) and `warmup` leaves nothing to compile for the first request that has
        some.
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
        program = StepProgram(
            graphdef,
            kv_scale,
            num_logprobs,
            return_probs,
            mesh=mesh,
            head_axis=None if mesh is None else resolve_head_axis(mesh),
            aux_layer_ids=self.aux_layer_ids,
            layout=layout,
            data_parallel_axis=data_parallel_axis,
            # (each group's parameters: those split over the group axis come in as its share)
            param_specs=None
            if data_parallel_axis is None
            else _Frozen.of(jax.tree.map(lambda leaf: _group_spec(leaf, data_parallel_axis), self.params)),
        )
        self._fn, self._drafts = _jitted_steps(program)
        self._signatures: set[Any] = set()  # the step programs (argument shapes) this runner has run
        self._recompiles = 0  # jit cache entries a known signature added (shardings or types that drifted)
        self.vocab_size = model.config.vocab_size
        self.penalty_slots = penalty_slots
        # (counts, prompt): each group's padding row 0, then its slots; stacked over the groups, each group's rows
        # on its devices (split over the data-parallel axis); None without slots
        self._penalty_state: tuple[jax.Array, jax.Array] | None = None
        if penalty_slots:
            shape, spec = (self.groups * (penalty_slots + 1), self.vocab_size), _penalty_spec(data_parallel_axis)
            self._penalty_state = (_zeros(shape, jnp.int32, mesh, spec), _zeros(shape, jnp.bool_, mesh, spec))
        per_group = data_parallel_axis is not None
        self._start_slot = _start_slot_per_group(mesh, data_parallel_axis) if per_group else _start_slot
        self._slots: dict[str, tuple[int, int]] = {}  # request id -> (its group, its row among the group's)
        self.max_rows = max_rows
        self._prev_tokens: jax.Array | None = None  # [max_rows] the tokens the last dispatched step sampled
        self.last_times = (0.0, 0.0)

    @property
    def platform(self) -> str:
        """The platform the step runs on (``"cpu"``, ``"gpu"``, ``"tpu"``: its cache's devices')."""
        return next(iter(jax.tree.leaves(self.cache)[0].devices())).platform

    @property
    def compilations(self) -> int:
        """Step programs this runner has run so far (one per bucket used), each compiled once per process: a
        runner of an equal `StepProgram` takes the same ones (`_jitted_steps`). A step whose argument shapes
        ran before but that still added a jit cache entry (its arrays' shardings or types drifted) counts too."""
        return len(self._signatures) + self._recompiles

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
        args = self.step_args(inputs)
        leaves, treedef = jax.tree.flatten(args[2:])
        signature = (treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
        entries = self._fn._cache_size()
        out, self.cache, state, self._prev_tokens, self.last_aux = self._fn(*args)
        if signature in self._signatures and self._fn._cache_size() > entries:
            self._recompiles += 1
        self._signatures.add(signature)
        if state is not None:
            self._penalty_state = state
        return out

    def step_args(self, inputs: StepInputs) -> tuple:
        """The arguments of the jitted step (`run_step`) for `inputs`: ``(params, cache, inputs, penalty state,
        penalty rows, the previous step's tokens)``; the penalty state and rows None when the runner has no
        penalty slots (a request's first penalized step takes a count row of its group: `_penalty_slot`)."""
        state = rows = None
        if self._penalty_state is not None or inputs.penalized:  # per row: its count row (0: none), its penalties
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
        if inputs.prev_index is None:  # (one program whether or not a step came before)
            inputs = dataclasses.replace(inputs, prev_index=np.full(inputs.tokens.shape, -1, np.int32))
        if self._prev_tokens is None:
            # a data-parallel step constrains them replicated, spelled ``P()``; GSPMD spells its own ``P(None)``
            spec = PartitionSpec() if self.data_parallel_axis is not None else None
            self._prev_tokens = _zeros((self.max_rows,), jnp.int32, self.mesh, spec)
        return self.params, self.cache, inputs, state, rows, self._prev_tokens

    def dispatch_drafts(self, inputs: StepInputs, seq_rows: np.ndarray, counts: np.ndarray, num_steps: int) -> Any:
        """Greedy drafting in one jitted call (`draft_steps`): the step of `inputs` (each drafting sequence's
        unseen tokens, sampling its first draft from sample row ``seq_rows[s]``), then ``num_steps - 1`` decode
        steps of one token per sequence, each feeding the sequence's previous draft. `counts` ``[S]``: drafts each
        sequence wants (0 for padding); a sequence past its count computes nothing. Returns a handle:
        ``np.asarray`` of it is ``[num_steps, S]`` drafts (``-1`` past a count)."""
        drafts, self.cache = self._drafts(
            self.params,
            self.cache,
            dataclasses.replace(inputs, prev_index=None),  # (all its tokens are on the host)
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
        """The row among its group's penalty rows that counts `req`'s tokens (1 ..`penalty_slots`: a step's
        rows index their own group's); a new one starts from its prompt and output."""
        taken = self._slots.get(req.request_id)
        if taken is not None:
            return taken[1]
        if self._penalty_state is None:
            raise RuntimeError("this runner has no penalty slots (penalty_slots=0)")
        group = req.group if self.data_parallel_axis is not None else 0
        used = {slot for g, slot in self._slots.values() if g == group}
        free = sorted(set(range(1, self.penalty_slots + 1)) - used)
        if not free:
            raise RuntimeError(f"more than {self.penalty_slots} requests with penalties at once in group {group}")
        self._slots[req.request_id] = (group, free[0])
        prompt, output = list(req.prompt), list(req.output)
        n = len(prompt) + len(output)
        tokens = np.zeros(max(64, 1 << (n - 1).bit_length()), np.int32)  # pow-2 bucket
        tokens[:n] = prompt + output
        row = group * (self.penalty_slots + 1) + free[0]  # of the stacked rows
        self._penalty_state = self._start_slot(self._penalty_state, row, tokens, len(prompt), n)
        return free[0]

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


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The fixed part of a `ModelRunner`'s step functions (bound with `functools.partial` before `jax.jit`):
    the model's graph, how it samples, where it runs."""

    graphdef: Any  # the model's `nnx` graph (its parameters are the step's first argument)
    kv_scale: float  # dequantisation scale of fp8 pools
    num_logprobs: int  # top logprobs each row returns
    return_probs: bool  # speculation: verify each row's draft (`verify_drafts`)
    mesh: Any = None
    head_axis: str | None = None  # the mesh axis of the heads (head-parallel kernels)
    aux_layer_ids: tuple[int, ...] = ()  # layers whose input residual streams a step returns (EAGLE3)
    layout: SparseKVLayout | None = None  # the pools' layout (data parallel: every group's rows)
    data_parallel_axis: str | None = None
    param_specs: Any = None  # data parallel: how each parameter enters a group (`_group_spec`), a `_Frozen` tree


@dataclasses.dataclass(frozen=True)
class _Frozen:
    """A pytree of hashable leaves (partition specs) as a hashable value: its structure and leaves."""

    treedef: Any
    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, tree: Any) -> _Frozen:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(leaves))

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaves)


#: `StepProgram`s whose jitted steps a process keeps (`_jitted_steps`).
SHARED_PROGRAMS = 8


@functools.lru_cache(maxsize=SHARED_PROGRAMS)
def _jitted_steps(program: StepProgram) -> tuple[Any, Any]:
    """``(step, drafts)``: `run_step` and `draft_steps` of `program`, jitted (the cache and the penalty state
    donated). Runners of equal programs (one model graph, pools, mesh and sampling outputs: engines of one
    configuration) share them, so a second engine traces, lowers and compiles nothing; the last
    `SHARED_PROGRAMS` programs are kept (their executables with them)."""
    step = jax.jit(functools.partial(run_step, program), donate_argnums=(1, 3))
    drafts = jax.jit(functools.partial(draft_steps, program), donate_argnums=(1,), static_argnames=("num_steps",))
    return step, drafts


def model_logits(program: StepProgram, params, cache, inputs: StepInputs, aux_ids: tuple[int, ...]):
    """The model over one step's (one group's) ragged tokens: ``(logits [R, vocab], cache, aux or None)``; the LM
    head runs only on the rows that choose a token."""
    model = nnx.merge(program.graphdef, params)
    features = inputs.image_features
    index = None if features is None else inputs.image_index[:, None]
    _, positions, table = ragged_token_rows(
        inputs.cu_q_lens, inputs.kv_lens, inputs.page_indices, inputs.tokens.shape[0]
    )
    pages = inputs.page_indices
    groups = AttentionGroups(inputs.decode, pages[inputs.decode_seq], inputs.blocks, pages[inputs.block_seq])
    # head-parallel kernels (shard_map over the heads) only where no group axis is manual already
    mesh = program.mesh
    with contextlib.nullcontext() if mesh is None else head_parallel(mesh, program.head_axis):
        got = model(
            inputs.tokens[:, None],
            positions[:, None],
            cache,
            table,
            kv_scale=program.kv_scale,
            logits_indices=inputs.sample_rows,
            attention_groups=groups,
            image_features=features,
            image_index=index,
            aux_layer_ids=aux_ids,
        )
    return got[0][:, 0], got[1], got[2][:, 0] if len(got) > 2 else None  # aux: [T, len(aux_ids) * hidden]


def model_and_sample(program: StepProgram, params, cache, inputs: StepInputs, penalties, aux_ids: tuple[int, ...]):
    """The model, then the sampler on its rows: ``(sampled, cache, aux, penalty state)``, the state (None without
    penalties) ``(counts, prompt)`` with the sampled tokens counted."""
    logits, cache, aux = model_logits(program, params, cache, inputs, aux_ids)
    sampled = sample(logits, inputs.sampling, program.num_logprobs, program.return_probs, penalties=penalties)
    state = None if penalties is None else (count_tokens(penalties, sampled[0]), penalties.prompt)
    return sampled, cache, aux, state


def model_and_sample_per_group(
    program: StepProgram, params, cache, inputs: StepInputs, penalties, aux_ids: tuple[int, ...]
):
    """`model_and_sample` run per data-parallel group: `jax.shard_map` manual over the group axis only, so each
    group sees its own slice of the stacked step arrays and its own shard of the pools, as a cache of the group's
    layout (its rows: its padding page, then its pages), and GSPMD still partitions heads and experts over the
    other axes. Parameters split over the axis (routed experts over every device) come in as each group's
    share; the rest are replicated over it. Logits never leave their group, nor do its penalty rows."""
    mesh, axis, layout = program.mesh, program.data_parallel_axis, program.layout
    local = dataclasses.replace(layout, num_slots=layout.num_rows // mesh.shape[axis] - layout.page_size)
    group = PartitionSpec(axis)
    cache_specs = jax.tree.map(lambda _: group, SparseKVCache.abstract(layout))
    penalty_specs = None if penalties is None else jax.tree.map(lambda _: group, penalties)  # (rows: its own)

    def body(params, cache, inputs, penalties):
        out, cache, aux, state = model_and_sample(
            program, params, dataclasses.replace(cache, layout=local), inputs, penalties, aux_ids
        )
        return out, dataclasses.replace(cache, layout=layout), aux, state

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(program.param_specs.tree(), cache_specs, jax.tree.map(lambda _: group, inputs), penalty_specs),
        out_specs=(group, cache_specs, group if aux_ids else None, None if penalties is None else (group, group)),
        axis_names={axis},
        check_vma=False,
    )(params, cache, inputs, penalties)


def run_step(program: StepProgram, params, cache, inputs: StepInputs, penalty_state, penalty_rows, prev_tokens):
    """One step (`ModelRunner`'s jitted program, `program` bound): ``(sampled, cache, penalty state, the next
    step's prev_tokens, aux)``.

    `penalty_state` ``(counts, prompt)`` and `penalty_rows` ``(slot, presence, frequency, repetition)``:
    `Penalties` (None: no row has any); the counts come back with the sampled tokens added. `prev_tokens`
    ``[max_rows]``: the tokens the step before sampled (async scheduling: ``inputs.prev_index`` says which
    token reads which row); None (drafting) skips that, the aux states and the next step's tokens."""
    if prev_tokens is not None:
        index = inputs.prev_index
        inputs = dataclasses.replace(
            inputs, tokens=jnp.where(index >= 0, prev_tokens[jnp.maximum(index, 0)], inputs.tokens)
        )
    inputs = dataclasses.replace(inputs, prev_index=None)
    penalties = None if penalty_state is None else Penalties(*penalty_state, *penalty_rows)
    forward = model_and_sample if program.data_parallel_axis is None else model_and_sample_per_group
    aux_ids = program.aux_layer_ids if prev_tokens is not None else ()
    out, cache, aux, state = forward(program, params, cache, inputs, penalties, aux_ids)
    mesh = program.mesh
    replicated = None if program.data_parallel_axis is None else NamedSharding(mesh, PartitionSpec())
    if mesh is not None:
        cache = keep_cache_shardings(cache, mesh, page_axis=program.data_parallel_axis)
    if replicated is not None:  # every process reads every group's rows; one program whatever GSPMD picked
        out = jax.lax.with_sharding_constraint(out, replicated)
    if state is not None and mesh is not None:  # as the runner made it: one program from the first step on
        state = jax.lax.with_sharding_constraint(state, NamedSharding(mesh, _penalty_spec(program.data_parallel_axis)))
    if prev_tokens is None:
        return out, cache, state, None, aux
    following = prev_tokens.at[: out[0].shape[0]].set(out[0])  # the next step's prev_tokens
    if replicated is not None:
        following = jax.lax.with_sharding_constraint(following, replicated)
    return out, cache, state, following, aux


def draft_steps(program: StepProgram, params, cache, inputs: StepInputs, seq_rows, counts, greedy, num_steps: int):
    """Greedy drafting (`ModelRunner.dispatch_drafts`'s program): the step of `inputs`, then ``num_steps - 1``
    steps of one token per sequence (its last draft; `greedy`: their sampling rows), in one program:
    ``([num_steps, S] drafts, -1 past a sequence's count), cache``."""
    out, cache, _, _, _ = run_step(program, params, cache, inputs, None, None, None)
    num_seqs = inputs.kv_lens.shape[0]
    first = out[0][jnp.maximum(seq_rows, 0)]  # [S] each sequence's first draft
    index = jnp.arange(num_seqs, dtype=jnp.int32)
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32)

    def next_draft(carry, j):  # sequence s feeds its draft j at position kv_lens[s] + j - 1
        cache, last = carry
        active = j < counts  # it wants draft j + 1; the others run as padding (position -1: no write)
        one_each = StepInputs(  # a decode row per sequence (rows only)
            last,
            cu,
            jnp.where(active, inputs.kv_lens + j, 0),
            inputs.page_indices,
            index,
            greedy,
            index[:, None],
            index,
            jnp.zeros((0, 1), jnp.int32),
            jnp.zeros(0, jnp.int32),
        )
        out, cache, _, _, _ = run_step(program, params, cache, one_each, None, None, None)
        return (cache, jnp.where(active, out[0], last)), jnp.where(active, out[0], -1)

    (cache, _), rest = jax.lax.scan(next_draft, (cache, first), jnp.arange(1, num_steps, dtype=jnp.int32))
    return jnp.concatenate([jnp.where(counts >= 1, first, -1)[None], rest]), cache


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


def _replicated(mesh: Any, ndim: int) -> NamedSharding:
    """Replicated over `mesh`, spelled as a step gives its outputs back (a spec of ``ndim`` Nones: a differently
    spelled equal sharding would take a second jit cache entry)."""
    return NamedSharding(mesh, PartitionSpec(*(None,) * ndim))


def _zeros(shape: tuple[int, ...], dtype: Any, mesh: Any, spec: PartitionSpec | None = None) -> jax.Array:
    """Zeros replicated over `mesh`, placed as a step gives the array back (one program whether or not a step
    came before): spelled `spec`, by default `_replicated`'s; one device without a mesh."""
    if mesh is None:
        return jnp.zeros(shape, dtype)
    sharding = _replicated(mesh, len(shape)) if spec is None else NamedSharding(mesh, spec)
    return jax.device_put(np.zeros(shape, dtype), sharding)


def _penalty_spec(data_parallel_axis: str | None) -> PartitionSpec:
    """The penalty state's rows split over the data-parallel groups (each group's on its devices), else
    replicated - each spelled as a step gives them back (a differently spelled equal sharding would take a
    second jit cache entry)."""
    return PartitionSpec(None, None) if data_parallel_axis is None else PartitionSpec(data_parallel_axis)


def _slot_rows(vocab: int, tokens, num_prompt, num_tokens) -> tuple[jax.Array, jax.Array]:
    """``(counts [vocab] int32, prompt [vocab] bool)`` of a request of ``tokens[:num_prompt]`` prompt and
    ``tokens[num_prompt:num_tokens]`` output (``tokens`` padded to a bucket)."""
    index = jnp.arange(tokens.shape[0])
    in_output = (index >= num_prompt) & (index < num_tokens)
    counts = jnp.zeros(vocab, jnp.int32).at[tokens].add(in_output.astype(jnp.int32))
    outside = jnp.where(index < num_prompt, tokens, vocab)  # past the vocabulary: dropped
    return counts, jnp.zeros(vocab, jnp.bool_).at[outside].set(True, mode="drop")


@functools.partial(jax.jit, donate_argnums=(0,))
def _start_slot(state, row, tokens, num_prompt, num_tokens):
    """Penalty row `row` of ``state = (counts, prompt)`` for a request (`_slot_rows`), in place."""
    counts, prompt = state
    new_counts, new_prompt = _slot_rows(counts.shape[1], tokens, num_prompt, num_tokens)
    return counts.at[row].set(new_counts), prompt.at[row].set(new_prompt)


def _start_slot_per_group(mesh: Any, axis: str):
    """`_start_slot` over a state whose rows split over the data-parallel `axis`: each group writes the row if it
    holds it and rewrites its own row otherwise (`jax.shard_map`: no group's rows cross devices)."""

    def body(state, row, tokens, num_prompt, num_tokens):
        counts, prompt = state
        local = row - jax.lax.axis_index(axis) * counts.shape[0]
        mine = (local >= 0) & (local < counts.shape[0])
        local = jnp.clip(local, 0, counts.shape[0] - 1)
        new_counts, new_prompt = _slot_rows(counts.shape[1], tokens, num_prompt, num_tokens)
        counts = counts.at[local].set(jnp.where(mine, new_counts, counts[local]))
        return counts, prompt.at[local].set(jnp.where(mine, new_prompt, prompt[local]))

    spec = _penalty_spec(axis)
    per_group = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=((spec, spec), PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(spec, spec),
        axis_names={axis},
        check_vma=False,
    )
    return jax.jit(per_group, donate_argnums=(0,))
