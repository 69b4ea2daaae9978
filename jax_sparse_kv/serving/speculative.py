"""Speculative decoding: drafts proposed on the host, verified in the ragged step, lossless.

A decoding request with ``k`` drafts contributes ``1 + k`` query tokens to a
step: its last token and the drafts, at their own positions. They are written
to the cache like any tokens and attend causally through it, so each row sees
exactly what sequential decoding would have seen (the sparse layers' indexer
chooses blocks per query by its own position). Row ``j`` gives the target
distribution ``p_j`` of the token after draft ``j``.

Verification (`verify`), per request:

- greedy: accept drafts while each equals the argmax of its row; then the row
  after the last accepted draft gives one more token. Output identical to
  non-speculative greedy decoding.
- sampling (Leviathan et al. 2023, with a deterministic draft, i.e. a draft
  distribution that puts all mass on ``d``): accept ``d_j`` with probability
  ``p_j(d_j)``; on rejection emit a sample of ``p_j`` with ``d_j`` removed and
  renormalised, and stop. If every draft is accepted the last row's own sample
  is the extra token. The emitted tokens are distributed as ``p``. The random
  numbers of the token at position ``n`` come from the request's seed and
  ``n`` only.

Rows written for rejected drafts lie past the request's committed length: the
next step overwrites them and nothing reads past a query's own position, so
they never reach a result (a paged cache needs no `move_kv_cache` for linear
drafts: accepted rows are already where sequential decoding would have put them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.serving.model_runner import ModelRunner, StepShapes, bucket_of
from jax_sparse_kv.serving.request import Request, Status
from jax_sparse_kv.serving.scheduler import ScheduledSeq, StepPlan

__all__ = [
    "Speculation",
    "SpeculationContext",
    "NgramSpeculation",
    "NgramIndex",
    "DraftModelSpeculation",
    "Eagle3Speculation",
    "verify",
    "ngram_drafts",
]


@dataclasses.dataclass(frozen=True)
class SpeculationContext:
    """What a speculation method knows of the engine that uses it: fixed facts, built once by the engine and
    handed to `Speculation.attach`. Everything that changes step to step (the live requests, the step's aux
    hidden states) comes as arguments of the per-step hooks instead, so calls go one way (engine ->
    speculation) and a method runs without an engine (a test builds a context by hand)."""

    max_model_len: int  # prompt + output limit: drafts past it are cut (`Speculation.limit`)
    max_seqs: int  # sequences in one step (a draft model's sample rows)
    max_tokens_per_step: int  # token budget of one step (a draft model's catch-up chunks)
    page_size: int  # tokens per page (one page id covers every pool, the draft's too)
    num_slots: int  # usable slots of the target's pools; rows: these + the padding page (page ids 1..num_pages)
    dtype: Any  # the target's pool dtype
    vocab_size: int  # the target model's vocabulary (a draft must share it)
    hidden_size: int  # the target model's hidden size (an EAGLE3 head reads its residual streams)
    shapes: StepShapes  # the engine's step buckets (a draft's steps use the same)
    kv_scale: float = 1.0  # dequantisation scale of fp8 pools
    mesh: Any = None  # the device mesh the target runs on (None: one device)
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose input residual streams each step returns
    # data-parallel attention: groups, and the pages of one group's pool rows (its padding page + its pages).
    # A request's page ids are its group's; group g's page p is row block g * group_pages + p of the pools, and
    # group g's tokens fill rows g * T .. of a step's arrays (T = the step's tokens per group).
    data_parallel_size: int = 1
    group_pages: int = 0


class Speculation:
    """Base of the drafting methods: `propose` gives a decoding request's drafts before each step.

    The engine calls `attach` once with its `SpeculationContext`, then per step `propose` (each decoding
    request), `finalize` (the plan), `observe` (each verification) and `after_step` (the plan, the ids of
    the requests still live, the step's aux states); a method never calls back into the engine."""

    num_tokens: int = 0

    def attach(self, context: SpeculationContext) -> None:
        """Called once by the engine that uses it, with the engine's fixed facts."""
        self.context = context

    def propose(self, request: Request) -> list[int]:
        raise NotImplementedError

    def finalize(self, plan: StepPlan) -> StepPlan:
        """Called with each plan after scheduling (pages for the drafts are taken): the final drafts."""
        return plan

    def after_step(self, plan: StepPlan, live: Container[str], aux: Any = None) -> None:
        """Called after each step, once its tokens are committed: `live` holds the ids of the requests the
        engine still serves (state of any other - finished, aborted - may go); `aux` the step's aux hidden
        states (`ModelRunner.last_aux`; None when the step returned none or nothing ran)."""

    def observe(self, request: Request, num_drafts: int, accepted: int) -> None:
        """Called when a verification of `request`'s `num_drafts` drafts accepted the first `accepted`."""

    def limit(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts cut so that the request's token budget and ``max_model_len`` hold even if all are accepted."""
        p = request.params
        room = min(p.max_tokens - len(request.output), self.context.max_model_len - request.num_tokens) - 1
        return drafts[: max(0, min(room, self.num_tokens))]


def ngram_drafts(tokens: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    arr = np.asarray(tokens)
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = arr[size - n :]
        # windows starting at i = 0 .. size - n - 1 (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + num_tokens]]
    return []


class NgramIndex:
    """The latest start of every n-gram (``min_ngram``..``max_ngram`` tokens) of a growing token sequence,
    updated per new token: `drafts` equals `ngram_drafts` on the whole sequence, in time O(new tokens) instead
    of O(context) (memory: ~100 bytes per token per n-gram length)."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def drafts(self, token_slice: Any, size: int, num_tokens: int) -> list[int]:
        """Drafts for the first `size` tokens (``token_slice(a, b)`` gives ``tokens[a:b]``)."""
        # the n-grams of tokens[: size - 1] (every window but the suffix itself), latest start last
        lo = max(0, self.indexed - self.max_ngram + 1)
        known = token_slice(lo, size)
        for end in range(self.indexed, size - 1):
            for n, table in self.latest.items():
                if end - n + 1 >= 0:
                    table[tuple(known[end - n + 1 - lo : end + 1 - lo])] = end - n + 1
        self.indexed = max(self.indexed, size - 1)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            start = self.latest[n].get(tuple(known[size - n - lo :]))
            if start is not None:
                return token_slice(start + n, min(start + n + num_tokens, size))
        return []


@dataclasses.dataclass
class NgramSpeculation(Speculation):
    """Prompt-lookup drafting: up to `num_tokens` drafts from the request's own prompt + output.

    The longest suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) that
    occurred before proposes the tokens that followed it.

    `adaptive`: each request's draft count follows its acceptance, as in transformers' assisted generation
    (its "heuristic" schedule): +2 after a verification that accepts every draft, -1 after one that does not,
    between 1 and `num_tokens` (starting at `num_tokens`). A request whose output does not quote its context
    then verifies one draft a step instead of `num_tokens`; one that quotes keeps about the full count, less
    after each miss. Off by default (every request drafts up to `num_tokens`, as vLLM's n-gram speculation
    does); ``benchmarks.scale`` (section 4) measures both. The output is the same either way (speculation is
    lossless); only the number and size of the steps change.
    """

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        self._indexes: dict[str, NgramIndex] = {}  # request id -> the index of its tokens
        self._counts: dict[str, int] = {}  # request id -> its draft count (adaptive)

    def propose(self, request: Request) -> list[int]:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(self.min_ngram, self.max_ngram)
        count = self._counts.get(request.request_id, self.num_tokens)
        return self.limit(request, index.drafts(request.token_slice, request.num_tokens, count))

    def observe(self, request: Request, num_drafts: int, accepted: int) -> None:
        if self.adaptive:
            count = self._counts.get(request.request_id, self.num_tokens)
            count = count + 2 if accepted == num_drafts else count - 1
            self._counts[request.request_id] = min(self.num_tokens, max(1, count))

    def after_step(self, plan: StepPlan, live: Container[str], aux: Any = None) -> None:
        for rid in [r for r in self._indexes if r not in live]:  # finished or aborted
            del self._indexes[rid]
            self._counts.pop(rid, None)


class DraftModelSpeculation(Speculation):
    """Drafts from a smaller `MiniMaxM3` with the same vocabulary, decoding greedily.

    The draft model has its own cache pools over the **same page ids** as the
    target (a request's pages hold its draft K/V too), so it needs no pages of
    its own. Before each step, one jitted call drafts for every decoding
    request (`ModelRunner.dispatch_drafts`): a step of the tokens each has not
    seen, which samples its first draft, then `num_tokens - 1` greedy decode
    steps on the device; unseen tokens past the step's token budget (a new
    prompt) are caught up first, in chunks under the budget. Draft rows of rejected drafts lie past
    the request's committed length and are rewritten next time; a preempted
    request's draft starts over with its recompute.
    """

    def __init__(self, draft_model: Any, num_tokens: int = 4):
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.draft_model = draft_model
        self.num_tokens = num_tokens
        self._computed: dict[str, int] = {}  # request id -> draft K/V rows valid for its tokens
        self._written: dict[str, int] = {}

    def attach(self, context: SpeculationContext) -> None:
        super().attach(context)
        c = self.draft_model.config
        if c.vocab_size != context.vocab_size:
            raise ValueError(f"draft_model vocab_size={c.vocab_size} differs from the model's {context.vocab_size}")
        layout = c.layout(num_slots=context.num_slots, page_size=context.page_size, dtype=context.dtype)
        self.runner = ModelRunner(
            self.draft_model,
            layout,
            kv_scale=context.kv_scale,
            num_logprobs=0,
            mesh=context.mesh,
            max_rows=context.max_seqs,
        )
        self.shapes = dataclasses.replace(context.shapes, rows_per_seq=1)

    def propose(self, request: Request) -> list[int]:
        return [0] * len(self.limit(request, [0] * self.num_tokens))  # placeholders: pages are reserved for these

    def finalize(self, plan: StepPlan) -> StepPlan:
        todo = [s for s in plan.seqs if s.drafts]
        if not todo:
            return plan
        drafts = self._draft([s.request for s in todo], [len(s.drafts) for s in todo])
        final = {id(s): dataclasses.replace(s, drafts=tuple(d)) for s, d in zip(todo, drafts, strict=True)}
        return dataclasses.replace(plan, seqs=[final.get(id(s), s) for s in plan.seqs])

    def _draft(self, requests: list[Request], counts: list[int]) -> list[list[int]]:
        """Each request's `counts` greedy drafts, in one jitted call (`ModelRunner.dispatch_drafts`): a step of
        every request's unseen tokens (sampling its first draft), then ``num_tokens - 1`` decode steps on the
        device. Unseen tokens past the step budget (a new prompt) go first in catch-up steps that sample
        nothing, chunked under the budget, dispatched without waiting."""
        budget = self.context.max_tokens_per_step
        computed = [self._computed.get(r.request_id, 0) for r in requests]
        while sum(r.num_tokens - c for r, c in zip(requests, computed, strict=True)) > budget:
            seqs, left = [], budget
            for i, r in enumerate(requests):  # each keeps its last token for the drafting call
                take = min(r.num_tokens - 1 - computed[i], left)
                if take > 0:
                    seqs.append(ScheduledSeq(r, computed[i], take, sample=False))
                    computed[i] += take
                    left -= take
            self.runner.dispatch(self.shapes.inputs(seqs, greedy=True)[0])
        seqs = [ScheduledSeq(r, c, r.num_tokens - c, sample=True) for r, c in zip(requests, computed, strict=True)]
        inputs, rows = self.shapes.inputs(seqs, greedy=True)
        num_seqs = len(inputs.kv_lens)
        seq_rows, wanted = np.full(num_seqs, -1, np.int32), np.zeros(num_seqs, np.int32)
        seq_rows[: len(rows)], wanted[: len(counts)] = rows, counts
        drafts = np.asarray(self.runner.dispatch_drafts(inputs, seq_rows, wanted, self.num_tokens))
        for r, n in zip(requests, counts, strict=True):  # its draft rows: its tokens and the drafts it fed
            self._written[r.request_id] = r.num_tokens + n - 1
        return [drafts[:n, i].tolist() for i, n in enumerate(counts)]

    def after_step(self, plan: StepPlan, live: Container[str], aux: Any = None) -> None:
        for req in plan.preempted:
            self._computed.pop(req.request_id, None)
        for rid in [r for r in self._computed if r not in live]:  # finished or aborted
            del self._computed[rid]
        for seq in plan.seqs:
            rid = seq.request.request_id
            if seq.request.status == Status.FINISHED:
                self._written.pop(rid, None)
            elif rid in self._written:  # draft rows of accepted tokens stay valid, those of rejected ones do not
                self._computed[rid] = min(self._written.pop(rid), seq.request.num_computed)


class Eagle3Speculation(Speculation):
    """Drafts from an EAGLE3 head (`jax_sparse_kv.nn.Eagle3Draft`) reading the target's own hidden states.

    The target's step also returns the residual streams entering the head's aux layers for every token it
    computes (`ModelRunner` ``aux_layer_ids``: the same forward). After each step, one jitted call
    (`Eagle3Draft.draft`) per step:

    1. catch-up: every position ``p`` the step committed (a prefill chunk's tokens, a verification's last
       token and accepted drafts) gets a draft row from the target's aux states at ``p`` and the token at
       ``p + 1`` (the bonus token for the last one), its K/V written to the draft's pools;
    2. drafting, for each request now decoding: the last catch-up row's argmax is draft 1, then
       ``num_tokens - 1`` rows feed each draft back with the draft's own hidden state.

    The drafts wait on the host for the request's next step (`propose`). The draft's K/V pools
    (``[num_pages * page_size, kv_heads, head_dim]`` each, the engine's dtype; a GQA head's are small) are
    indexed by the **request's own page ids**, so the draft needs no pages of its own; rows of rejected
    drafts lie past the committed length and are rewritten by the next catch-up. Lossless by the engine's
    verification (greedy and sampled: the draft is deterministic).

    Limits: a request's first drafts come one step after its prompt is computed (they need the target's
    states of the whole prompt, which the catch-up takes from the steps that computed it); a prefix shared
    from the prefix cache reuses the draft rows the first request wrote (the row of a page's last position
    depends on the next page's first token, so acceptance, never the output, may differ); a preempted
    request's draft rows are recomputed with its prompt. A request drafts no further than the pages it
    holds after the step (the scheduler reserves the next step's); near a page's end that may be fewer than
    ``num_tokens``. Draft attention reads each row's pages per query
    (`jax_sparse_kv.ops.dense_attention`, one query per row): a long prefill chunk costs its length times
    its context in reads, as decode rows do. Images: the catch-up takes the target's states of image
    positions like any other (the embedding of a placeholder token is the draft's, as vLLM's is).
    """

    def __init__(self, draft: Any, num_tokens: int = 3):
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.draft = draft
        self.num_tokens = num_tokens
        self._drafts: dict[str, list[int]] = {}  # request id -> drafts for its next step
        self._fn = jax.jit(draft.draft, donate_argnums=(1, 2), static_argnames=("page_size", "num_steps"))

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose input residual streams the engine's step returns for the head."""
        return tuple(self.draft.aux_layer_ids)

    def attach(self, context: SpeculationContext) -> None:
        super().attach(context)
        t, c = context, self.draft.config
        if c.hidden_size != t.hidden_size or c.vocab_size != t.vocab_size:
            raise ValueError(
                f"EAGLE3 head (hidden_size={c.hidden_size}, vocab_size={c.vocab_size}) does not fit "
                f"the model (hidden_size={t.hidden_size}, vocab_size={t.vocab_size})"
            )
        if context.aux_layer_ids != self.aux_layer_ids:
            raise ValueError("the engine's step does not return the EAGLE3 head's aux hidden states")
        # as many rows as the target's pools: its usable slots and the padding page (page ids run 1..num_pages,
        # so the last page's rows end at num_slots + page_size)
        shape = (context.num_slots + context.page_size, c.num_key_value_heads, c.head_dim)
        zeros = jnp.zeros(shape, context.dtype)
        if context.mesh is not None:
            zeros = jax.device_put(zeros, jax.sharding.NamedSharding(context.mesh, jax.sharding.PartitionSpec()))
        self.k_pool, self.v_pool = zeros, jnp.copy(zeros)
        self.page_size = context.page_size
        self.params = self.draft.params
        if context.mesh is not None:  # on the engine's mesh (data-parallel attention runs it with Auto axes)
            self.params = jax.tree.map(
                lambda a: (
                    jax.device_put(a, jax.sharding.NamedSharding(context.mesh, a.sharding.spec))
                    if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)
                    else a
                ),
                self.draft.params,
            )

    def propose(self, request: Request) -> list[int]:
        return self.limit(request, self._drafts.get(request.request_id, []))

    def after_step(self, plan: StepPlan, live: Container[str], aux: Any = None) -> None:
        for rid in [r for r in self._drafts if r not in live]:  # finished or aborted
            del self._drafts[rid]
        for req in plan.preempted:
            self._drafts.pop(req.request_id, None)
        if not plan.seqs or aux is None:
            return
        rows, tokens, positions, tables, seqs = [], [], [], [], []
        groups = self.context.data_parallel_size
        per_group = aux.shape[0] // groups  # a step's rows per group (all of them without groups)
        offsets = [0] * groups  # the engine orders the plan's sequences group by group
        for seq in plan.seqs:
            req = seq.request
            first = req.group * per_group + offsets[req.group]
            offsets[req.group] += seq.num_tokens
            self._drafts.pop(req.request_id, None)
            if req.status != Status.RUNNING:
                continue
            end = min(req.num_computed, req.num_tokens - 1)  # positions whose next token is known
            if end <= seq.start:
                continue
            n = end - seq.start
            rows.append(np.arange(first, first + n))
            tokens.append(np.asarray(req.token_slice(seq.start + 1, end + 1)))
            positions.append(np.arange(seq.start, end))
            tables.extend([len(positions) - 1] * n)
            decoding = req.num_computed == req.num_tokens - 1 and req.matcher is None and not req.params.penalized
            want = len(self.limit(req, [0] * self.num_tokens)) if decoding else 0
            # draft j >= 2 writes its K/V at position num_tokens + j - 2, in a page the request must hold already
            want = min(want, 1 + len(req.pages) * self.page_size - (req.num_tokens - 1))
            seqs.append((req, sum(len(r) for r in rows) - 1, want))
        if not seqs:
            return
        shapes = self.context.shapes
        # the step's buckets are per group: G groups' rows and sequences fit G times a group's bucket
        num = groups * bucket_of(-(-sum(len(r) for r in rows) // groups), shapes.token_buckets)
        num_seqs = groups * bucket_of(-(-len(seqs) // groups), shapes.seq_buckets)
        width = bucket_of(max(len(r.pages) for r, _, _ in seqs), shapes.table_buckets)
        page_tables = np.zeros((num_seqs, width), np.int32)
        for i, (req, _, _) in enumerate(seqs):  # the pools' page ids (a group's own ids offset to its rows)
            page_tables[i, : len(req.pages)] = req.page_array() + req.group * self.context.group_pages
        real = sum(len(r) for r in rows)
        pad = lambda parts, fill: np.concatenate(parts + [np.full(num - real, fill)]).astype(np.int32)  # noqa: E731
        pos = pad(positions, -1)
        seq_of = np.asarray(tables + [0] * (num - real), np.int32)
        slots = np.where(
            pos >= 0,
            page_tables[seq_of, np.maximum(pos, 0) // self.page_size] * self.page_size
            + np.maximum(pos, 0) % self.page_size,
            self.k_pool.shape[0],
        ).astype(np.int32)
        last, counts, next_pos = (np.zeros(num_seqs, np.int32) for _ in range(3))
        for i, (req, row, want) in enumerate(seqs):
            last[i], counts[i], next_pos[i] = row, want, req.num_tokens - 1
        drafts, self.k_pool, self.v_pool = self._fn(
            self.params,
            self.k_pool,
            self.v_pool,
            aux,
            pad(rows, 0),
            pad(tokens, 0),
            pos,
            slots,
            page_tables[seq_of],
            last,
            page_tables,
            next_pos,
            counts,
            page_size=self.page_size,
            num_steps=self.num_tokens,
        )
        drafts = np.asarray(drafts)
        for i, (req, _, want) in enumerate(seqs):
            if want:
                self._drafts[req.request_id] = drafts[:want, i].tolist()


def verify(request: Request, drafts: tuple[int, ...], result: Any, first: int) -> tuple[list[int], int, list[int]]:
    """Accepts a prefix of `drafts` from the step's rows ``first .. first + len(drafts)``.

    Returns ``(tokens to emit, drafts accepted, row of each emitted token)``;
    the emitted tokens are the accepted drafts and one more token.
    """
    p = request.params
    greedy = p.temperature <= 0 or p.top_k == 1
    out: list[int] = []
    rows: list[int] = []
    for j, d in enumerate(drafts):
        row = first + j
        if greedy:
            if int(result.tokens[row]) != d:
                out.append(int(result.tokens[row]))
                rows.append(row)
                return out, j, rows
        elif not result.accept[row]:  # rejected on the device: its draw of p without d (`verify_drafts`)
            token = int(result.residual[row]) if result.residual[row] >= 0 else int(result.tokens[row])
            out.append(token)
            rows.append(row)
            return out, j, rows
        out.append(int(d))
        rows.append(row)
    row = first + len(drafts)
    out.append(int(result.tokens[row]))
    rows.append(row)
    return out, len(drafts), rows
