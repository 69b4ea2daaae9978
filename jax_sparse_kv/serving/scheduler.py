"""The host scheduler: which requests run in the next step, with how many tokens, in which pages.

Pure Python, one plan per step (vLLM v1's shape):

1. running requests that decode (one token each, plus their drafts when speculating);
2. running requests in the middle of a chunked prefill;
3. waiting requests, first come first served (preempted ones first), each
   matching its prompt against the prefix cache before its first chunk; one
   that cannot start for want of pages lets those behind it try (no
   head-of-line blocking), and one preempted in this step waits for the next;

until the step's token budget (``max_tokens_per_step``) or ``max_seqs`` is
used up. Pages are taken as tokens need them. When a running request needs a
page and none is left, a running request is preempted: the one with the most
output tokens still to generate (``max_tokens`` minus those it has), the
newest of those on a tie. Its pages are released (full ones stay cached for
its recompute), it goes back to the front of the queue, and nothing it
generated is lost. So a short request that arrives while long ones fill the
cache starts once a long one gives way, and the long ones, not it, give way
after: it is served within a few steps (a strict newest-first victim and a
blocking queue head made it wait for the long requests to end).

A plan advances each scheduled request's ``num_computed`` and counts the token
it will sample as a placeholder (`Request.placeholders`), so the next plan can
be made while this step runs (async scheduling); a request whose sampled
tokens will reach ``max_tokens`` waits for them.
"""

from __future__ import annotations

import collections
import dataclasses

from jax_sparse_kv.serving.kv_cache_manager import KVCacheManager
from jax_sparse_kv.serving.request import Request, Status

__all__ = ["DataParallelScheduler", "Scheduler", "ScheduledSeq", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step: tokens ``request.tokens[start : start + num_new]`` (then the drafts).

    ``sample`` is whether the step ends at the sequence's last token (known or placeholder), so its last row
    (and its draft rows) choose the next tokens; fixed when the sequence is scheduled.
    """

    request: Request
    start: int
    num_new: int
    drafts: tuple[int, ...] = ()
    sample: bool = None  # type: ignore[assignment]  # None: from the request's tokens now

    def __post_init__(self):
        if self.sample is None:
            total = self.request.num_tokens + getattr(self.request, "placeholders", 0)
            object.__setattr__(self, "sample", self.start + self.num_new == total)

    @property
    def num_tokens(self) -> int:
        return self.num_new + len(self.drafts)


@dataclasses.dataclass
class StepPlan:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    """Holds the waiting and running queues and plans steps over a `KVCacheManager`."""

    def __init__(self, kv: KVCacheManager, max_seqs: int, max_tokens_per_step: int):
        self.kv = kv
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.prefix_hit_tokens = 0
        self.prefill_tokens = 0  # tokens scheduled that were not a decode's one token
        self.preemptions = 0
        self.host = None  # a `HostKVCache` whose pages extend prefix matches (Engine(host_cache_pages=))
        self.host_offset = 0  # what this scheduler's page ids are offset by in the pools (data-parallel groups)
        self.host_hit_tokens = 0  # prompt tokens restored from the host tier
        self._host_hit = 0  # of the last _match_prefix

    # ----------------------------------------------------------- requests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (finished or aborted) and releases its pages."""
        if request.status == Status.RUNNING:
            self.running.remove(request)
        elif request.status == Status.WAITING:
            self.waiting.remove(request)
        self.kv.release(request.pages)
        request.pages, request.hashes = [], []
        request.status, request.finish_reason = Status.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        budget = self.max_tokens_per_step
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        decoding = [r for r in self.running if r.is_decoding]
        prefilling = [r for r in self.running if not r.is_decoding]
        for req in decoding + prefilling:
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            if req.placeholders and len(req.output) + req.placeholders >= req.params.max_tokens:
                continue  # the token on the device is its last: nothing to compute for it
            drafts = tuple(req.drafts[: max(0, budget - 1)]) if req.is_decoding else ()
            n = min(req.remaining, budget - len(drafts))
            if n <= 0:
                break
            while not self._grow(req, req.num_computed + n + len(drafts)):
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                budget += sum(s.num_tokens for s in seqs if s.request is victim)  # its tokens come back
                seqs = [s for s in seqs if s.request is not victim]
                if victim is req:
                    break
            if req.status == Status.RUNNING:
                seqs.append(ScheduledSeq(req, req.num_computed, n, drafts))
                budget -= n + len(drafts)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_seqs:
                break
            if req.placeholders or req in preempted:  # preempted while its step ran, or in this plan: later
                continue
            first = req.sibling  # a child of n > 1: once the first child has computed the prompt (shared pages)
            if first is not None and first.status != Status.FINISHED and first.num_computed < len(first.prompt):
                continue
            hit = self._match_prefix(req) if req.num_computed == 0 and not req.pages else 0
            n = min(req.remaining, budget)
            if not self._grow(req, req.num_computed + n):  # no room: admitting never preempts
                if hit:  # give the prefix back until the request can start
                    self.kv.release(req.pages)
                    req.pages, req.hashes, req.num_computed = [], [], 0
                    self.prefix_hit_tokens -= hit - self._host_hit
                    self.host_hit_tokens -= self._host_hit
                continue  # a smaller request behind it may fit
            self.waiting.remove(req)
            if req.cached_tokens is None:  # its first start: what the prefix cache gave it
                req.cached_tokens = req.num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(ScheduledSeq(req, req.num_computed, n))
            budget -= n
        for seq in seqs:  # the plan's tokens count as computed; each sampled token is a placeholder until read
            if not (seq.num_new == 1 and seq.request.is_decoding):
                self.prefill_tokens += seq.num_new
            seq.request.num_computed = seq.start + seq.num_new
            seq.request.placeholders += seq.sample
        return StepPlan(seqs, preempted)

    def _match_prefix(self, req: Request) -> int:
        """Shares the cached full pages of the request's known tokens (at least its last token is left to compute).

        Returns the tokens matched. With a host tier (``self.host``), the match goes on there after the
        device's: those pages are copied back into fresh device pages before the step (`HostKVCache`).
        """
        self._host_hit = 0
        if not self.kv.prefix_caching:
            return 0
        max_pages = (req.num_tokens - 1) // self.kv.page_size
        chain = req.prefix_hashes(self.kv.page_size, max_pages)
        pages = self.kv.match_hashes(chain, max_pages)
        if pages:
            self.kv.share(pages)
        restored = 0
        if self.host is not None and len(pages) < max_pages:
            pages, restored = self.host.restore_prefix(self.kv, chain[:max_pages], pages, self.host_offset)
        if pages:
            req.pages, req.hashes = pages, chain[: len(pages)]
            req.num_computed = len(pages) * self.kv.page_size
            self._host_hit = restored * self.kv.page_size
            self.prefix_hit_tokens += req.num_computed - self._host_hit
            self.host_hit_tokens += self._host_hit
        return req.num_computed

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Gives `req` pages for `num_tokens` tokens; False (nothing taken) if short."""
        need = self.kv.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        pages = self.kv.allocate(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _victim(self) -> Request:
        """The running request that gives way: the most output tokens still to generate, the newest on a tie."""

        def left(i: int) -> tuple[int, int]:
            r = self.running[i]
            return r.params.max_tokens - len(r.output) - r.placeholders, i

        return self.running[max(range(len(self.running)), key=left)]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req.pages)
        req.pages, req.hashes, req.num_computed, req.drafts = [], [], 0, []
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.preemptions += 1

    # ------------------------------------------------------------ updates

    def commit(self, seq: ScheduledSeq, accepted: int) -> None:
        """After a step (its sampled tokens appended): `accepted` drafts join the computed tokens; pages whose
        tokens are all known and computed join the prefix cache. Nothing for a request no longer running
        (finished, aborted or preempted while the step ran)."""
        req = seq.request
        if req.status != Status.RUNNING:
            return
        req.num_computed += accepted
        full = min(req.num_computed, req.num_tokens) // self.kv.page_size
        if full > len(req.hashes):  # pages newly full
            chain = req.prefix_hashes(self.kv.page_size, full)
            for i in range(len(req.hashes), full):
                req.hashes.append(self.kv.register_hash(req.pages[i], chain[i]))


class DataParallelScheduler:
    """One `Scheduler` per data-parallel group (each over its own `KVCacheManager`, its own ``max_seqs`` and
    token budget), seen by the engine as one.

    A request is placed on a group when it is added and stays there (its pages are that group's): the group
    whose prefix cache holds most of its prompt, then the one with fewest requests, then the first. A child of
    ``n > 1`` goes where its first sibling is (they share the prompt's pages). Each group plans, preempts and
    commits on its own; a step's plan is every group's, in group order (`StepPlan.seqs`, each request's
    ``group`` telling them apart).
    """

    def __init__(self, managers: list[KVCacheManager], max_seqs: int, max_tokens_per_step: int):
        self.groups = [Scheduler(kv, max_seqs, max_tokens_per_step) for kv in managers]
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step

    @property
    def running(self) -> list[Request]:
        return [r for g in self.groups for r in g.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for g in self.groups for r in g.waiting]

    def __getattr__(self, name: str) -> int:
        """The counters (``prefix_hit_tokens``, ``prefill_tokens``, ``preemptions``, ``host_hit_tokens``): all
        groups' sums."""
        if name in ("prefix_hit_tokens", "prefill_tokens", "preemptions", "host_hit_tokens"):
            return sum(getattr(g, name) for g in self.groups)
        raise AttributeError(name)

    def add(self, request: Request) -> None:
        request.group = self._place(request)
        self.groups[request.group].add(request)

    def _place(self, request: Request) -> int:
        if request.sibling is not None:
            return request.sibling.group
        kv = self.groups[0].kv
        hits = [0] * len(self.groups)
        if kv.prefix_caching:
            max_pages = (request.num_tokens - 1) // kv.page_size
            chain = request.prefix_hashes(kv.page_size, max_pages)
            hits = [len(g.kv.match_hashes(chain, max_pages)) for g in self.groups]
        load = [len(g.running) + len(g.waiting) for g in self.groups]
        return max(range(len(self.groups)), key=lambda g: (hits[g], -load[g], -g))

    def finish(self, request: Request, reason: str) -> None:
        self.groups[request.group].finish(request, reason)

    def has_unfinished(self) -> bool:
        return any(g.has_unfinished() for g in self.groups)

    def schedule(self) -> StepPlan:
        plans = [g.schedule() for g in self.groups]
        return StepPlan([s for p in plans for s in p.seqs], [r for p in plans for r in p.preempted])

    def commit(self, seq: ScheduledSeq, accepted: int) -> None:
        self.groups[seq.request.group].commit(seq, accepted)
