"""``--reasoning-parser``: text between think tags goes to ``reasoning_content``, the rest to ``content``.

`ReasoningParser.feed` takes the output text in pieces of any size (streamed deltas) and returns what
each piece adds to the reasoning and to the content; `finish` returns what is left. The tags
themselves never reach either side, even when a tag arrives split over several pieces (a text ending
in a prefix of a tag is held back until the next piece says whether it is one). The non-streamed
response is the same parser fed everything at once, so both agree.

Parsers (`PARSERS`):

- ``think``: ``<think>`` opens reasoning and ``</think>`` closes it (DeepSeek-R1, Qwen3, MiniMax-M2.5+
  style). When the prompt itself ends with ``<think>`` (a chat template that opens the block for the
  model), the output starts inside the reasoning.
- ``minimax_m2``: the same tags, and the output always starts inside the reasoning (MiniMax-M2's
  template opens the block; the model only writes ``</think>``).
- ``minimax_m3``: MiniMax-M3's ``<mm:think>`` / ``</mm:think>`` (special tokens in its tokenizer, kept
  when detokenizing for the parser). The output starts inside the reasoning when the prompt ends with
  ``<mm:think>`` (the template's ``thinking_mode`` opens the block) or the model writes the tag. A
  ``</mm:think>`` outside the reasoning is dropped when it leads the output (nothing before it), and
  kept as content text after other text (``XXX</mm:think>YYY`` is all content), as vLLM and SGLang do.
- ``minimax_m2_append_think`` (vLLM's name): nothing goes to the reasoning; the content is ``<think>``
  followed by the output as written, so a client that replays the assistant message sends the think
  block back the way MiniMax-M2's template expects it.
- ``auto`` (`resolve_parser`): ``minimax_m3`` when the checkpoint's tokenizer has ``<mm:think>``,
  else ``think`` when it has ``<think>``, else none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["ReasoningParser", "PARSERS", "make_parser", "resolve_parser"]


@dataclasses.dataclass(frozen=True)
class ParserSpec:
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    #: an end tag outside the reasoning, after other text, stays in the content (else it is dropped)
    keep_stray_end: bool = False
    #: everything is content, prefixed with `start` (the block the template opened, kept for replay)
    append_think: bool = False


PARSERS = {
    "think": ParserSpec(),
    "minimax_m2": ParserSpec(starts_in_reasoning=True),
    "minimax_m3": ParserSpec("<mm:think>", "</mm:think>", keep_stray_end=True),
    "minimax_m2_append_think": ParserSpec(starts_in_reasoning=True, append_think=True),
}
#: ``--reasoning-parser auto``: the first parser whose start tag the tokenizer knows.
AUTO_ORDER = ("minimax_m3", "think")


def resolve_parser(name: str | None, has_token: Callable[[str], bool]) -> str | None:
    """The parser a server runs: `name`, or for ``"auto"`` the one the tokenizer's tags say (None if none).

    `has_token(text)` says whether the tokenizer has `text` as one token. Raises `ValueError` for an
    unknown name.
    """
    if name is None:
        return None
    if name == "auto":
        return next((p for p in AUTO_ORDER if has_token(PARSERS[p].start) and has_token(PARSERS[p].end)), None)
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join([*PARSERS, 'auto'])}")
    return name


class ReasoningParser:
    """Splits output text into (reasoning, content) deltas; see the module docstring.

    Both tags are removed wherever they appear: the start tag switches to reasoning, the end tag to
    content (a stray tag of the state already in force is dropped, never shown), except that with
    `keep_stray_end` an end tag met in the content after other output is content text. With
    `append_think` nothing is split: the content is `start` followed by the output as written.
    """

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        in_reasoning: bool = False,
        *,
        keep_stray_end: bool = False,
        append_think: bool = False,
    ):
        if not start or not end:
            raise ValueError("think tags must be non-empty")
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self.keep_stray_end = keep_stray_end
        self.append_think = append_think
        self._held = ""
        self._begun = False  # any output (or, with append_think, the start tag) went out

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) this piece of text adds."""
        if self.append_think:
            head = "" if self._begun else self.start
            self._begun = True
            return "", head + text
        buf = self._held + text
        self._held = ""
        reasoning, content = [], []
        while buf:
            hits = [(i, tag) for tag in (self.start, self.end) if (i := buf.find(tag)) >= 0]
            if hits:
                i, tag = min(hits)
                (reasoning if self.in_reasoning else content).append(buf[:i])
                self._begun = self._begun or i > 0
                if tag == self.end and not self.in_reasoning and self.keep_stray_end and self._begun:
                    content.append(tag)  # ``XXX</mm:think>YYY``: the tag is text
                else:
                    self.in_reasoning = tag == self.start
                self._begun = True
                buf = buf[i + len(tag) :]
                continue
            keep = self._partial_tag(buf)
            (reasoning if self.in_reasoning else content).append(buf[: len(buf) - keep])
            self._begun = self._begun or len(buf) > keep
            self._held = buf[len(buf) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back at the end (a prefix of a tag that never completed is plain text)."""
        if self.append_think:
            return self.feed("")
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)

    def _partial_tag(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a tag."""
        for n in range(min(len(text), max(len(self.start), len(self.end)) - 1), 0, -1):
            suffix = text[-n:]
            if self.start.startswith(suffix) or self.end.startswith(suffix):
                return n
        return 0

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole text."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


def make_parser(name: str, prompt_text: str = "") -> ReasoningParser:
    """A fresh parser for one output; `prompt_text` ending in the start tag means the output starts inside."""
    try:
        spec = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
    opened = prompt_text.rstrip().endswith(spec.start)
    return ReasoningParser(
        spec.start,
        spec.end,
        in_reasoning=spec.starts_in_reasoning or opened,
        keep_stray_end=spec.keep_stray_end,
        append_think=spec.append_think,
    )
