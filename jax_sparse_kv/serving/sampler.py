"""Sampling on device: greedy, temperature, top-k, top-p, min-p, seeded per token; logprobs.

One function of the jitted step. Each row is one token to choose (a sequence's
next token) with its own parameters. The random key of a row is derived from
the request's seed and the position of the token being chosen only, so a
seeded request's tokens never depend on the rest of the batch, on how the
step was composed or on preemption.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.serving.structured import apply_bitmask, fill_bitmasks

__all__ = [
    "SamplingRows",
    "sampling_rows",
    "Penalties",
    "sample",
    "verify_drafts",
    "token_keys",
    "biased_logits",
    "penalized_logits",
    "count_tokens",
    "penalty_state_bytes",
    "BIAS_SLOTS",
]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "position",
        "bias_ids",
        "bias",
        "logprobs",
        "bitmask",
        "draft",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters, all ``[rows]``.

    ``temperature`` 0 (or ``top_k`` 1) is greedy; ``top_k`` 0 keeps every
    token; ``seed`` (uint32) and ``position`` (of the token being chosen) make its key.
    ``bias_ids`` / ``bias`` ``[rows, K]``: logit biases (`SamplingParams.logit_bias`, and ``-inf`` on
    the stop tokens while ``min_tokens`` holds them back); an id of ``vocab`` or more is no entry.
    ``K`` is 0 in a step where no row has any (its program skips them) and `BIAS_SLOTS` otherwise.
    ``logprobs``: the most likely tokens whose logprobs the row's request asks for (``-1``: none; then,
    when no row of the step asks, the step computes no log-softmax over the vocabulary).
    ``bitmask`` ``[rows, W]`` int32: structured outputs' allowed tokens (bit ``t % 32`` of word ``t // 32``;
    all ones: unconstrained); ``W`` is 0 in a step where no row is constrained.
    ``draft``: the speculative draft token the row's choice verifies (``-1``: none).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    position: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    logprobs: jax.Array
    bitmask: jax.Array
    draft: jax.Array

    @classmethod
    def from_numpy(
        cls,
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        position,
        bias_ids=None,
        bias=None,
        logprobs=None,
        bitmask=None,
        draft=None,
    ) -> SamplingRows:
        rows = len(temperature)
        bias_ids = np.zeros((rows, 0), np.int32) if bias_ids is None else np.asarray(bias_ids, np.int32)
        bias = np.zeros(bias_ids.shape, np.float32) if bias is None else np.asarray(bias, np.float32)
        logprobs = np.full(rows, -1, np.int32) if logprobs is None else np.asarray(logprobs, np.int32)
        bitmask = np.zeros((rows, 0), np.int32) if bitmask is None else np.asarray(bitmask, np.int32)
        draft = np.full(rows, -1, np.int32) if draft is None else np.asarray(draft, np.int32)
        return cls(
            np.asarray(temperature, np.float32),
            np.asarray(top_k, np.int32),
            np.asarray(top_p, np.float32),
            np.asarray(min_p, np.float32),
            np.asarray(seed, np.uint32),
            np.asarray(position, np.int32),
            bias_ids,
            bias,
            logprobs,
            bitmask,
            draft,
        )


#: bias entries per row in a step where any row has some: `MAX_LOGIT_BIAS` plus room for stop tokens
BIAS_SLOTS = 512


def sampling_rows(
    seqs: Sequence[Any], firsts: Sequence[int], num_rows: int, greedy: bool = False, eos: Sequence[int] = ()
) -> tuple[SamplingRows, list[tuple[int, Any]]]:
    """The host `SamplingRows` of a step's scheduled sequences (`jax_sparse_kv.serving.scheduler.ScheduledSeq`),
    `num_rows` rows (the rest neutral), and ``(row, request)`` of each row with presence / frequency / repetition
    penalties (their counts live on the device: `Penalties`).

    A sequence that samples has rows ``firsts[s] ..``: its last real token, then each draft (the row verifying
    it). `greedy` (a draft model drafting) makes every row greedy, with no logprobs, biases, grammar or
    penalties (the target checks those). `eos`: the model's EOS ids, held back (with the request's stop ids)
    from a row whose request has not reached ``min_tokens``."""
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "position", "logprobs", "draft")
    cols = {k: np.zeros(num_rows) for k in names}
    cols["top_p"][:] = 1.0
    cols["logprobs"][:] = -1
    cols["draft"][:] = -1
    biased: dict[int, dict[int, float]] = {}  # row -> its bias entries (logit_bias, min_tokens' -inf)
    penalized: list[tuple[int, Any]] = []
    constrained: list[tuple[Any, int]] = []  # (matcher, row) of rows a grammar constrains
    for seq, first in zip(seqs, firsts, strict=True):
        if not seq.sample:
            continue
        req, p, end = seq.request, seq.request.params, seq.start + seq.num_new
        for j in range(1 + len(seq.drafts)):  # the last real token, then each draft
            row = first + j
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
            if greedy:
                continue
            if req.constrained:  # structured outputs: the grammar's allowed tokens
                constrained.append((req.matcher, row))
            entries = dict(p.logit_bias or {})
            if end + j - len(req.prompt) < p.min_tokens:  # a stop token here would end it too soon
                entries.update(dict.fromkeys(tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos)), -np.inf))
            if entries:
                biased[row] = entries
            if p.penalized:
                penalized.append((row, req))
    if biased:
        cols["bias_ids"] = np.full((num_rows, BIAS_SLOTS), np.iinfo(np.int32).max, np.int32)  # no entry
        cols["bias"] = np.zeros((num_rows, BIAS_SLOTS), np.float32)
        for r, entries in biased.items():
            cols["bias_ids"][r, : len(entries)] = list(entries)
            cols["bias"][r, : len(entries)] = list(entries.values())
    if constrained:
        cols["bitmask"] = np.full((num_rows, constrained[0][0].words), -1, np.int32)  # all ones: all allowed
        fill_bitmasks(constrained, cols["bitmask"])
    return SamplingRows.from_numpy(**cols), penalized


def biased_logits(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """``[rows, vocab]`` logits plus each row's biases (ids past the vocabulary are dropped), then its structured
    outputs' mask (disallowed tokens at ``-inf``)."""
    if rows.bias_ids.shape[-1]:
        index = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[index, rows.bias_ids].add(rows.bias, mode="drop")
    if rows.bitmask.shape[-1]:
        logits = apply_bitmask(logits, rows.bitmask)
    return logits


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["counts", "prompt", "slot", "presence", "frequency", "repetition"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Presence / frequency / repetition penalties of a step's rows, with their token counts kept on the device.

    ``counts [slots, vocab]`` int32: how often each token occurs in the output of the request holding slot
    ``s`` (slot 0 holds none); ``prompt [slots, vocab]`` bool: which tokens its prompt holds. Per row:
    ``slot`` (0: the row's request has no penalties; its parameters are then neutral), ``presence``,
    ``frequency``, ``repetition`` (1: none).
    """

    counts: jax.Array
    prompt: jax.Array
    slot: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array


def penalized_logits(logits: jax.Array, p: Penalties) -> jax.Array:
    """vLLM's penalties on ``[rows, vocab]`` logits: repetition over prompt and output tokens (a positive logit
    divided by it, a negative one multiplied), then ``frequency * count + presence * (count > 0)`` subtracted."""
    counts = p.counts[p.slot]
    seen = p.prompt[p.slot] | (counts > 0)
    rep = p.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)


def count_tokens(p: Penalties, tokens: jax.Array) -> jax.Array:
    """The counts after the rows' chosen ``tokens [rows]`` (rows of slot 0 change nothing that is read)."""
    return p.counts.at[p.slot, tokens].add(jnp.where(p.slot > 0, 1, 0))


def penalty_state_bytes(slots: int, vocab_size: int) -> int:
    """Bytes of one group's penalty state, held on each of its devices for the engine's life: for each of
    ``slots + 1`` rows (row 0: no penalties) an int32 count and a bool "in the prompt" per token id
    (``Penalties.counts`` and ``Penalties.prompt``, ``[slots + 1, vocab]``)."""
    return (slots + 1) * vocab_size * (jnp.dtype(jnp.int32).itemsize + jnp.dtype(jnp.bool_).itemsize)


def token_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    """``[rows]`` PRNG keys: one per (seed, position), independent of anything else."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p))(seed, position)


def filtered_logits(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """``[rows, vocab]`` logits scaled by temperature with tokens outside top-k / top-p / min-p at ``-inf``.

    The token of highest probability always survives. No sort of the vocabulary: top-k and top-p become a
    probability threshold per row, found by bisection over the bits of a float32 probability (exact in 32
    rounds of compares and sums over the vocabulary, which vectorize on every backend); a step where no row
    uses top-k or top-p skips even that. Tokens tied with the last one kept are all kept (a sort keeps the
    lower ids); otherwise the kept set is `ranked_filters`' (what tests compare against).
    """
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    scaled = logits / temp
    probs = jax.nn.softmax(scaled, axis=-1)
    best = jnp.max(probs, axis=-1)
    uses = (rows.top_k > 0) | (rows.top_p < 1.0)
    threshold = jax.lax.cond(
        jnp.any(uses), _rank_thresholds, lambda p, r: jnp.zeros(p.shape[0], jnp.int32), probs, rows
    )
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # probabilities >= 0: float order is int order
    keep = (bits >= jnp.where(uses, threshold, 0)[:, None]) & (probs >= rows.min_p[:, None] * best[:, None])
    keep |= probs >= best[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def _rank_thresholds(probs: jax.Array, rows: SamplingRows) -> jax.Array:
    """``[rows]`` int32 bits of the smallest probability top-k and top-p keep (``0``: every token).

    For each row the largest ``t`` with ``count(p >= t) >= top_k`` (top-k) and the largest with
    ``mass(p >= t) >= top_p`` (the nucleus: the first token at which the mass of the better ones reaches top-p is
    kept), each by bisection over the 2**31 non-negative float32 bit patterns; the larger of the two applies.
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    total = jnp.sum(probs, axis=-1)
    top_p = jnp.minimum(rows.top_p, total)  # rounding: the whole vocabulary always reaches "1"
    k = jnp.where(rows.top_k > 0, rows.top_k, 1)

    def enough_k(t):  # [rows] bool: t keeps >= top_k tokens (monotone: true for small t)
        return jnp.sum(bits >= t[:, None], axis=-1) >= k

    def enough_p(t):  # [rows] bool: the tokens t keeps hold >= top_p of the mass
        return jnp.sum(jnp.where(bits >= t[:, None], probs, 0.0), axis=-1) >= top_p

    def bisect(_, bounds):  # two searches at once: enough(lo) holds, enough(hi) does not
        (lo_k, hi_k), (lo_p, hi_p) = bounds
        mid_k, mid_p = lo_k + (hi_k - lo_k) // 2, lo_p + (hi_p - lo_p) // 2
        good_k, good_p = enough_k(mid_k), enough_p(mid_p)
        return (
            (jnp.where(good_k, mid_k, lo_k), jnp.where(good_k, hi_k, mid_k)),
            (jnp.where(good_p, mid_p, lo_p), jnp.where(good_p, hi_p, mid_p)),
        )

    zero, top = jnp.zeros(probs.shape[0], jnp.int32), jnp.max(bits, axis=-1) + 1
    (t_k, _), (t_p, _) = jax.lax.fori_loop(0, 32, bisect, ((zero, top), (zero, top)))
    # each filter keeps the tokens at or above its threshold; both apply
    return jnp.maximum(jnp.where(rows.top_k > 0, t_k, 0), jnp.where(rows.top_p < 1.0, t_p, 0))


def ranked_filters(scaled: jax.Array, rows: SamplingRows) -> jax.Array:
    """The sort-based reference of `filtered_logits` (after temperature): rank the vocabulary, keep the top-k,
    the prefix whose better mass is below top-p, and min-p of the best. Tests and benchmarks compare with it."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # descending; ties keep the lower id first
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (rows.top_k[:, None] <= 0) | (rank < rows.top_k[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    keep &= before < rows.top_p[:, None]
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    ranked = jnp.where(keep, ranked, -jnp.inf)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(ranked, inverse, axis=-1)


def verify_drafts(probs: jax.Array, logprobs: jax.Array, rows: SamplingRows):
    """Speculative rejection sampling on the device, for deterministic drafts (Leviathan et al. with a one-hot
    draft distribution): a row's draft ``d`` is accepted with probability ``p[d]``; when it is not, the row
    emits a draw of ``p`` without ``d``, renormalized (its `residual`). The keys are the row's own (seed,
    position), so the outcome does not depend on the batch.

    Args:
      probs: ``[rows, vocab]`` the sampling distribution (after temperature and filters).
      logprobs: ``[rows, vocab]`` the model's logprobs (what the emitted tokens' logprobs report).
      rows: the rows' `SamplingRows` (``draft`` ``-1``: a row that verifies nothing).

    Returns:
      ``(accept [rows] bool, residual [rows] int32, draft_logprob [rows], residual_logprob [rows])``; a row
      whose ``p`` holds nothing but its draft has ``residual = -1`` (then the row's own sample stands).
    """
    n = probs.shape[0]
    draft = jnp.maximum(rows.draft, 0)
    keys = token_keys(rows.seed, rows.position)
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 0x5EC)))(keys)
    p_draft = probs[jnp.arange(n), draft]
    accept = (rows.draft >= 0) & (uniform < p_draft)
    rest = probs.at[jnp.arange(n), draft].set(0.0)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 0x5ED), (probs.shape[-1],)))(keys)
    residual = jnp.argmax(jnp.where(rest > 0, jnp.log(rest) + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
    residual = jnp.where(jnp.any(rest > 0, axis=-1), residual, -1)
    pick = lambda ids: logprobs[jnp.arange(n), jnp.maximum(ids, 0)]  # noqa: E731
    return accept, residual, pick(draft), pick(residual)


def sample(
    logits: jax.Array,
    rows: SamplingRows,
    num_logprobs: int = 0,
    return_probs: bool = False,
    penalties: Penalties | None = None,
):
    """Chooses one token per row.

    Args:
      logits: ``[rows, vocab]`` f32 model logits.
      rows: the rows' `SamplingRows`.
      num_logprobs: static count of most likely tokens whose logprobs come back.
      return_probs: static; speculative verification: also verify each row's ``draft`` (`verify_drafts`)
        on the device; only ``[rows]`` arrays come back, never a ``[rows, vocab]`` one.
      penalties: presence / frequency / repetition penalties (`Penalties`), applied after the biases to every
        row (those of slot 0 unchanged: their parameters are neutral). Not skipped under a `lax.cond` when no
        row has any: measured (benchmarks/penalties.py: a toy with M3's vocabulary, 16 rows, CPU), the
        conditional cost more than the penalties themselves (BENCHMARKS.md); None: none.

    Returns:
      ``(tokens [rows] int32, chosen_logprob [rows], top_ids [rows, n], top_logprobs [rows, n])``,
      then `verify_drafts`' four arrays if asked; logprobs are those of the model's distribution
      (before temperature and filters).
    """
    model_logits, logits = logits, biased_logits(logits, rows)
    if penalties is not None:  # on every row: slot 0's are neutral (no counts, no prompt, parameters 0, 0, 1)
        logits = penalized_logits(logits, penalties)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = (rows.temperature <= 0) | (rows.top_k == 1)

    def with_samples(filtered: jax.Array) -> jax.Array:
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(
            token_keys(rows.seed, rows.position)
        )
        return jnp.where(is_greedy, greedy, jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32))

    k = max(num_logprobs, 1)
    rows_n = logits.shape[0]
    none = (jnp.zeros(rows_n, jnp.float32), jnp.zeros((rows_n, k), jnp.int32), jnp.zeros((rows_n, k), jnp.float32))

    def with_logprobs(tokens: jax.Array) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        logprobs = jax.nn.log_softmax(model_logits, axis=-1)  # the model's, before biases, temperature, filters
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logprobs, k)
        return (chosen, top_ids.astype(jnp.int32), top_lp), logprobs

    def asked_logprobs(tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # a step where no row asks for logprobs computes no log-softmax over the vocabulary
        return jax.lax.cond(jnp.any(rows.logprobs >= 0), lambda: with_logprobs(tokens)[0], lambda: none)

    if return_probs:

        def verifying():  # rejection sampling needs the model's whole distribution anyway
            filtered = filtered_logits(logits, rows)
            tokens = with_samples(filtered)
            (chosen, top_ids, top_lp), logprobs = with_logprobs(tokens)
            return (tokens, chosen, top_ids, top_lp, *verify_drafts(jax.nn.softmax(filtered, axis=-1), logprobs, rows))

        def all_greedy():  # greedy drafts are checked against the argmax on the host: nothing else to compute
            verdicts = (jnp.zeros(rows_n, bool), jnp.full(rows_n, -1, jnp.int32), none[0], none[0])
            return (greedy, *asked_logprobs(greedy), *verdicts)

        return jax.lax.cond(jnp.all(is_greedy), all_greedy, verifying)
    # a step where every row is greedy skips the filters' sort over the vocabulary
    tokens = jax.lax.cond(jnp.all(is_greedy), lambda: greedy, lambda: with_samples(filtered_logits(logits, rows)))
    return tokens, *asked_logprobs(tokens)
