"""A request's host-side state: its tokens, how many are in the cache, its pages."""

from __future__ import annotations

import dataclasses
import enum

from jax_sparse_kv.serving.params import SamplingParams

__all__ = ["Request", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request.

    ``tokens`` (prompt + generated) are known; the first ``num_computed`` of
    them have K/V in the cache, in ``pages`` (page ``i`` holds tokens
    ``i * page_size : (i + 1) * page_size``). ``hashes[i]`` is the prefix hash
    of full page ``i`` once computed.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # the params' seed, or one drawn by the engine
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    hash_root: bytes | None = None  # the parent hash of the first page (a cache salt's), None: the shared root
    finish_reason: str | None = None
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculative tokens proposed for the next step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Known tokens not yet in the cache (1 while decoding: the last generated token)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output)
