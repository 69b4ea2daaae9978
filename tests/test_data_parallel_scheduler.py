"""`DataParallelScheduler`: placement of requests on data-parallel groups (host only, no device)."""

from __future__ import annotations

from jax_sparse_kv.serving.kv_cache_manager import KVCacheManager
from jax_sparse_kv.serving.params import SamplingParams
from jax_sparse_kv.serving.request import Request
from jax_sparse_kv.serving.scheduler import DataParallelScheduler

PAGE = 4


def _request(rid: str, prompt: list[int], sibling: Request | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), 0, arrival=0, sibling=sibling)


def test_placement_most_prefix_hits_then_fewest_requests_then_first():
    scheduler = DataParallelScheduler([KVCacheManager(16, PAGE) for _ in range(3)], max_seqs=4, max_tokens_per_step=16)
    shared = list(range(1, 13))  # 3 full pages
    # group 2's prefix cache holds the first two pages of `shared`
    owner = _request("owner", shared)
    chain = owner.prefix_hashes(PAGE, 2)
    kv = scheduler.groups[2].kv
    for page, h in zip(kv.allocate(2), chain, strict=True):
        kv.register_hash(page, h)
    first = _request("a", [50, 51])
    scheduler.add(first)
    assert first.group == 0  # nothing cached anywhere, all empty: the first group
    second = _request("b", [60])
    scheduler.add(second)
    assert second.group == 1  # fewest requests
    for i in range(3):  # group 2 now the most loaded
        scheduler.groups[2].add(_request(f"load{i}", [70 + i]))
    hit = _request("c", shared + [99])
    scheduler.add(hit)
    assert hit.group == 2  # most prefix hits wins over load
    child = _request("c-1", shared + [99], sibling=first)
    scheduler.add(child)
    assert child.group == first.group  # a child of n > 1 runs beside its first sibling (shared prompt pages)
    assert [len(g.waiting) for g in scheduler.groups] == [2, 1, 4]
    assert len(scheduler.waiting) == 7 and scheduler.preemptions == 0
