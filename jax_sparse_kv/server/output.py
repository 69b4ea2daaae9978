"""One choice's text as tokens arrive: detokenize, cut at stop strings, split off reasoning, then tool calls.

`ChoiceText.add(token_ids)` returns the `Delta` the new tokens add; `ChoiceText.finish()` what is
held back at the end. Streamed responses send each delta; non-streamed ones join them, so both
give the same text. Stop strings are searched in the whole text, so one split over several tokens
is found; text that could be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_sparse_kv.server.reasoning import ReasoningParser
from jax_sparse_kv.server.tool_parsers import ToolCallDelta, ToolCallParser

__all__ = ["StopStrings", "ChoiceText", "Delta"]


class StopStrings:
    """Text in, text safe to show out; `stopped` once a stop string appeared (it and what follows are cut)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        self._text += delta
        hits = [i for s in self.stops if (i := self._text.find(s, self._sent)) >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = len(self._text) - self._partial()
        out = self._text[self._sent : end]
        self._sent = end
        if self.stopped:
            self._text = self._text[:end]
        return out

    def finish(self) -> str:
        """The held-back tail (it never became a stop string)."""
        if self.stopped:
            return ""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out

    def _partial(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        unsent = len(self._text) - self._sent
        for n in range(min(unsent, max(map(len, self.stops)) - 1), 0, -1):
            suffix = self._text[-n:]
            if any(s.startswith(suffix) for s in self.stops):
                return n
        return 0


@dataclasses.dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.content + other.content, self.reasoning + other.reasoning, self.tool_calls + other.tool_calls)


class ChoiceText:
    """Detokenizer -> stop strings -> reasoning split -> tool calls (of the content), for one choice.

    Args:
      detokenizer: an object with ``add(ids) -> str`` and ``flush() -> str`` (`IncrementalDetokenizer`).
      stop: stop strings.
      reasoning: a `ReasoningParser`, or None (all text is content).
      tools: a `ToolCallParser` for the content (after the reasoning block), or None.
    """

    def __init__(
        self,
        detokenizer: Any,
        stop: Sequence[str] = (),
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
    ):
        self._detok = detokenizer
        self._stop = StopStrings(stop)
        self._reasoning = reasoning
        self.tools = tools

    @property
    def stopped(self) -> bool:
        """A stop string was found: the request should end now with ``finish_reason="stop"``."""
        return self._stop.stopped

    def add(self, token_ids: Sequence[int]) -> Delta:
        return self._split(self._stop.feed(self._detok.add(token_ids)), final=False)

    def finish(self) -> Delta:
        text = "" if self._stop.stopped else self._stop.feed(self._detok.flush())
        return self._split(text + self._stop.finish(), final=True)

    def _split(self, text: str, final: bool) -> Delta:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                r, c = self._reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.tools is None:
            return Delta(content=content, reasoning=reasoning)
        content, calls = self.tools.feed(content)
        if final:
            c, more = self.tools.finish()
            content, calls = content + c, calls + more
        return Delta(content=content, reasoning=reasoning, tool_calls=calls)
