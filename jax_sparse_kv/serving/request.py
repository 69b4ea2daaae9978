"""A request's host-side state: its tokens, how many are in the cache, its pages."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from jax_sparse_kv.serving.kv_cache_manager import page_hash
from jax_sparse_kv.serving.params import SamplingParams

__all__ = ["ImageSpan", "Request", "Status"]


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a request: its placeholders ``prompt[start : start + length]`` and what fills them.

    ``key`` is the content hash of the processed image (``pixel_values`` and ``grid_thw``): the encoder
    cache's key and part of the prefix-cache hash of every page the placeholders touch. A video is one span
    per temporal patch (its placeholders are cut by timestamp text and start/end tokens): all share the
    video's key, ``pixel_values`` and ``grid_thw [rows, 3]``; ``offset`` is the span's first row in the
    features of the whole video (0 for an image).
    """

    key: bytes
    start: int
    length: int
    pixel_values: Any  # [patches, patch_dim] float32
    grid_thw: Any  # [1, 3]; a video's [rows, 3]
    offset: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length


class Status(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request.

    ``tokens`` (prompt + generated) are known; ``placeholders`` more were sampled by steps still on the
    device (async scheduling: at most two, the newest tokens, whose values the next step reads on the device).
    The first ``num_computed`` of them have K/V in the cache (or in a step already dispatched), in ``pages``
    (page ``i`` holds tokens ``i * page_size : (i + 1) * page_size``). ``hashes[i]`` is the prefix hash of
    full page ``i`` once its tokens are known and computed.
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
    images: tuple[ImageSpan, ...] = ()  # the images whose placeholders the (expanded) prompt holds, in order
    matcher: Any = None  # structured outputs: the request's `structured.Matcher`
    constrained: bool = False  # the matcher masks the next token (after the reasoning block, if any)
    placeholders: int = 0  # tokens sampled by dispatched steps whose values the host has not read yet
    last_row: int = -1  # the sample row of the newest dispatched step that chose this request's next token
    cached_tokens: int | None = None  # prompt tokens read from the prefix cache at its first start (None: not yet)
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: per prompt position (PromptScorer's)
    sibling: Request | None = None  # SamplingParams.n: the first child, whose prompt this one waits for
    group: int = 0  # data-parallel attention: the group of devices it runs on (its pages are that group's)
    _chain: list[bytes] = dataclasses.field(default_factory=list, repr=False)  # prefix hashes of full pages
    _page_buffer: Any = dataclasses.field(default=None, repr=False)  # (list mirrored, int32 buffer, length)

    def prefix_hashes(self, page_size: int, n: int) -> list[bytes]:
        """The prefix-hash chain (`page_hash`) of the request's full pages, at least its first `n` (their tokens
        known): each page hashed once in the request's life, whether it waits, runs or is recomputed."""
        chain = self._chain
        for i in range(len(chain), n):
            parent = chain[-1] if chain else self.hash_root
            extra = self.page_extra(i, page_size) if self.images else b""
            chain.append(page_hash(parent, self.token_slice(i * page_size, (i + 1) * page_size), extra))
        return chain

    def page_array(self) -> np.ndarray:
        """``pages`` as int32, from a buffer kept in step with the list: pages appended since the last call are
        the only ones copied (a step's page table costs O(pages added), not O(context))."""
        pages, n = self.pages, len(self.pages)
        mirrored, buffer, filled = self._page_buffer or (None, None, 0)
        if mirrored is not pages or filled > n:  # a new list (preempted, finished, prefix matched)
            mirrored, buffer, filled = pages, np.empty(max(16, n), np.int32), 0
        if n > len(buffer):
            grown = np.empty(max(n, 2 * len(buffer)), np.int32)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if n > filled:
            buffer[filled:n] = pages[filled:n]
        self._page_buffer = (mirrored, buffer, n)
        return buffer[:n]

    def page_extra(self, page: int, page_size: int) -> bytes:
        """What besides its tokens a full page's prefix hash covers: the keys of the images it shows."""
        lo, hi = page * page_size, (page + 1) * page_size
        return b"".join(im.key for im in self.images if im.start < hi and im.end > lo)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole token list (host work per step O(tokens read))."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]

    @property
    def remaining(self) -> int:
        """Tokens (known or placeholders) not yet in the cache (1 while decoding: the last generated token)."""
        return self.num_tokens + self.placeholders - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output or self.placeholders)
