"""One choice's text as tokens arrive: detokenize, cut at stop strings, split off reasoning, then tool calls.

`ChoiceText.add(token_ids)` returns the `Delta` the new tokens add; `ChoiceText.finish()` what is
held back at the end. Streamed responses send each delta; non-streamed ones join them, so both
give the same text. Stop strings are found however the text arrives (one split over several tokens
too); text that could be the start of a stop string is held back until it is known not to be. The
first stop string to be completed ends the text (before it, or after it with ``include``).

`StopCheck` is the engine thread's side of the same rule: token ids in, and at the token that completes
a stop string, how many of the ids to keep (`jax_sparse_kv.server.engine_thread.EngineRunner` ends the
request there, so usage, token ids and logprobs stop at the token the text stops at).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_sparse_kv.server.reasoning import ReasoningParser
from jax_sparse_kv.server.tool_parsers import ToolCallDelta, ToolCallParser

__all__ = ["StopStrings", "StopCheck", "ChoiceText", "Delta"]


def _failure(s: str) -> list[int]:
    """KMP's failure function: ``f[i]`` is the longest proper prefix of ``s[: i + 1]`` that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopStrings:
    """Text in, text safe to show out; `stopped` once a stop string appeared (it - unless `include` - and what
    follows are cut).

    Each stop string is matched as a streaming automaton (Knuth-Morris-Pratt): per piece of text the work is
    linear in the piece and the number of stop strings, and only the unsent tail (shorter than the longest stop
    string) is kept, whatever the length of the output. The first stop string to be completed wins (of two
    completed by the same character, the longer one), so the result does not depend on how the text is split.
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.include = include
        self.stopped = False
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop string: how much of its start the text ends with
        self._held = ""  # the unsent tail: it could be the start of a stop string

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        base = len(self._held)
        text = self._held + delta
        stops, fails, states = self.stops, self._fail, self._state
        for pos, ch in enumerate(delta):
            done = -1
            for k, s in enumerate(stops):
                q = states[k]
                while q and s[q] != ch:
                    q = fails[k][q - 1]
                if s[q] == ch:
                    q += 1
                    if q == len(s):
                        if done < 0 or len(s) > len(stops[done]):
                            done = k
                        q = fails[k][q - 1]
                states[k] = q
            if done >= 0:
                self.stopped = True
                self._held = ""
                end = base + pos + 1
                return text[: end if self.include else end - len(stops[done])]
        held = max(states)
        self._held = text[len(text) - held :] if held else ""
        return text[: len(text) - held]

    def finish(self) -> str:
        """The held-back tail (it never became a stop string)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class StopCheck:
    """A request's stop strings over its token ids, for the engine thread (`EngineRunner.submit`'s stop checks).

    Called with each step's new token ids; returns None, or once a stop string is complete how many of the ids
    to keep (the token that completed it is the last). The detokenizer must be built as the one of the
    request's `ChoiceText` (same prompt and special-token handling), so both find the stop at the same token.
    """

    def __init__(self, detokenizer: Any, stops: Sequence[str], include: bool = False):
        self._detok = detokenizer
        self._stop = StopStrings(stops, include)

    def __call__(self, token_ids: Sequence[int]) -> int | None:
        if self._stop.stopped:
            return 0
        for i, token in enumerate(token_ids):
            self._stop.feed(self._detok.add([token]))
            if self._stop.stopped:
                return i + 1
        return None


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
      include_stop: keep the stop string that ends the text (vLLM's ``include_stop_str_in_output``).
      reasoning: a `ReasoningParser`, or None (all text is content).
      tools: a `ToolCallParser` for the content (after the reasoning block), or None.
    """

    def __init__(
        self,
        detokenizer: Any,
        stop: Sequence[str] = (),
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        include_stop: bool = False,
    ):
        self._detok = detokenizer
        self._stop = StopStrings(stop, include_stop)
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
