"""One choice's text as tokens arrive: detokenize, cut at stop strings, split off reasoning, then tool calls.

`ChoiceText.add(token_ids)` returns the `Delta` the new tokens add; `ChoiceText.finish()` what is
held back at the end. Streamed responses send each delta; non-streamed ones join them, so both
give the same text. Stop strings are found however the text arrives (one split over several tokens
too); text that could be the start of a stop string is held back until it is known not to be. The
first stop string to be completed ends the text (before it, or after it with ``include``).

`StopCheck` holds a choice's one detokenizer and its stop strings. With stop strings the engine thread runs
it on each step's tokens: at the token that completes a stop string it says how many of the ids to keep
(`jax_sparse_kv.server.engine_thread.EngineRunner` ends the request there, so usage, token ids and logprobs stop
at the token the text stops at), and the text it decoded (already cut) is what `ChoiceText` shows: each choice's
tokens are decoded once.
"""

from __future__ import annotations

import collections
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
    """One choice's text: its detokenizer and stop strings, run once for both the engine thread and the handler.

    The engine thread (`EngineRunner.submit`'s stop checks) calls it with each step's new token ids: it decodes
    them one at a time, records the text each shows (cut at the stop string, held back while it could start
    one), and returns None, or once a stop string is complete how many of the ids to keep (the token that
    completed it is the last; 0 after that). The handler's `ChoiceText` then reads that text with `text`,
    token for token, and trims nothing itself. Without stop strings (or for tokens the engine thread did not
    check: it is given no check, or it dropped a failed one) `text` decodes the ids itself, on the loop. The
    engine thread stops using a check before the output it finishes reaches the handler, so the two never
    decode at once.
    """

    def __init__(self, detokenizer: Any, stops: Sequence[str] = (), include: bool = False):
        self._detok = detokenizer
        self._stop = StopStrings(stops, include)
        self._texts: collections.deque[str] = collections.deque()  # per token checked: its text (engine -> loop)
        self._stop_at: int | None = None  # tokens up to the one completing the stop string (set by the checker)
        self._checked = 0  # tokens decoded so far (the checker's count)
        self._read = 0  # tokens whose text `text` has handed out (the handler's count)

    @property
    def stops(self) -> list[str]:
        return self._stop.stops

    def __call__(self, token_ids: Sequence[int]) -> int | None:
        if self._stop.stopped:
            return 0
        for i, token in enumerate(token_ids):
            self._checked += 1
            self._texts.append(self._stop.feed(self._detok.add([token])))
            if self._stop.stopped:
                self._stop_at = self._checked
                return i + 1
        return None

    @property
    def stopped(self) -> bool:
        """The handler has read the token that completed a stop string (its text ends there)."""
        return self._stop_at is not None and self._read >= self._stop_at

    def text(self, token_ids: Sequence[int]) -> str:
        """The text the handler shows for these ids (the next ones of the choice): what the checker recorded for
        them, the rest decoded and cut here."""
        parts = []
        while len(parts) < len(token_ids) and self._texts:
            parts.append(self._texts.popleft())
        rest = token_ids[len(parts) :]
        if rest:  # not checked by the engine thread (no stop strings, or no check): decode them here
            self._checked += len(rest)
            parts.append(self._stop.feed(self._detok.add(rest)))
            if self._stop.stopped and self._stop_at is None:
                self._stop_at = self._checked
        self._read += len(token_ids)
        return "".join(parts)

    def finish(self) -> str:
        """What is held back at the end (once the request finished): the detokenizer's tail and the text that
        could have started a stop string."""
        text = "" if self._stop.stopped else self._stop.feed(self._detok.flush())
        return text + self._stop.finish()


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
    """Text (`StopCheck`: detokenizer, stop strings) -> reasoning split -> tool calls (of the content), for one
    choice.

    Args:
      source: the choice's `StopCheck` (the one the engine thread runs, when it has stop strings), or a
        detokenizer (an object with ``add(ids) -> str`` and ``flush() -> str``, `IncrementalDetokenizer`), then
        wrapped in a `StopCheck` of `stop` / `include_stop`.
      stop: stop strings (with a detokenizer only).
      include_stop: keep the stop string that ends the text (vLLM's ``include_stop_str_in_output``).
      reasoning: a `ReasoningParser`, or None (all text is content).
      tools: a `ToolCallParser` for the content (after the reasoning block), or None.
    """

    def __init__(
        self,
        source: Any,
        stop: Sequence[str] = (),
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        include_stop: bool = False,
    ):
        if isinstance(source, StopCheck):
            if stop:
                raise ValueError("stop strings belong to the StopCheck given")
            self.check = source
        else:
            self.check = StopCheck(source, stop, include_stop)
        self.reasoning = reasoning
        self.tools = tools

    @property
    def stopped(self) -> bool:
        """A stop string was found: the request should end now with ``finish_reason="stop"``."""
        return self.check.stopped

    def add(self, token_ids: Sequence[int]) -> Delta:
        return self._split(self.check.text(token_ids), final=False)

    def finish(self) -> Delta:
        return self._split(self.check.finish(), final=True)

    def _split(self, text: str, final: bool) -> Delta:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if self.tools is None:
            return Delta(content=content, reasoning=reasoning)
        content, calls = self.tools.feed(content)
        if final:
            c, more = self.tools.finish()
            content, calls = content + c, calls + more
        return Delta(content=content, reasoning=reasoning, tool_calls=calls)
