"""One detokenizer per choice: the engine thread's `StopCheck` decodes and cuts the text, `ChoiceText` shows it.

Pure Python (the demo tokenizer): the text a choice shows when the engine thread ran its stop check equals the
text of a choice decoded on the loop alone, for every way the tokens arrive and with or without the stop string
kept; the detokenizer is run once per token, never a second time for the handler.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from jax_sparse_kv.server.output import ChoiceText, StopCheck  # noqa: E402
from jax_sparse_kv.server.reasoning import ReasoningParser  # noqa: E402
from jax_sparse_kv.server.tokenizer import TextTokenizer  # noqa: E402


class CountingDetokenizer:
    """A detokenizer that counts the token ids it decodes."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def add(self, ids):
        self.decoded += len(ids)
        return self.inner.add(ids)

    def flush(self):
        return self.inner.flush()


def _engine_then_handler(tok, ids, stops, include, steps, reasoning=False):
    """Runs a check as the engine thread does (step by step, cutting the kept ids), then the handler's
    `ChoiceText` over what the engine delivered; returns (reasoning, content, ids delivered, tokens decoded)."""
    detok = CountingDetokenizer(tok.detokenizer([]))
    check = StopCheck(detok, stops, include)
    text = ChoiceText(check, reasoning=ReasoningParser() if reasoning else None)
    delivered = []
    for step in steps:
        new = ids[step]
        keep = check(new)
        delivered.append(new if keep is None else new[:keep])
        if keep is not None:
            break
    deltas = [text.add(d) for d in delivered if d] + [text.finish()]
    reasoning_text = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning_text, content, [t for d in delivered for t in d], detok.decoded, text.stopped


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("split", ["whole", "tokens", "pairs"])
def test_the_engine_decodes_once_and_the_handler_shows_the_same_text(include, split):
    tok = TextTokenizer.demo(512)
    ids = tok.encode(" one two three four five")
    n = len(ids)
    steps = {
        "whole": [slice(0, n)],
        "tokens": [slice(i, i + 1) for i in range(n)],
        "pairs": [slice(i, i + 2) for i in range(0, n, 2)],
    }[split]
    reference = ChoiceText(tok.detokenizer([]), ["thr"], include_stop=include)
    whole = "".join(d.content for d in [reference.add(ids), reference.finish()])
    _, content, delivered, decoded, stopped = _engine_then_handler(tok, ids, ["thr"], include, steps)
    assert content == whole == (" one two thr" if include else " one two ")
    assert stopped and reference.stopped
    assert decoded == len(delivered)  # each delivered token decoded once, by the check
    # the ids stop at the token that completes the stop string
    assert "thr" in tok.decode(delivered) and "thr" not in tok.decode(delivered[:-1])


def test_no_stop_string_the_handler_decodes_the_tokens_itself():
    tok = TextTokenizer.demo(512)
    ids = tok.encode("<think>I should greet.</think>Hello there!")
    detok = CountingDetokenizer(tok.detokenizer([]))
    text = ChoiceText(StopCheck(detok), reasoning=ReasoningParser())
    deltas = [text.add([t]) for t in ids] + [text.finish()]
    assert "".join(d.reasoning for d in deltas) == "I should greet."
    assert "".join(d.content for d in deltas) == "Hello there!"
    assert detok.decoded == len(ids) and not text.stopped


def test_a_stop_inside_the_reasoning_split_matches_the_loop_only_text():
    tok = TextTokenizer.demo(512)
    ids = tok.encode("<think>I should greet.</think>Hello there! STOP and more")
    steps = [slice(i, i + 3) for i in range(0, len(ids), 3)]
    reasoning, content, _, _, stopped = _engine_then_handler(tok, ids, ["STOP"], False, steps, reasoning=True)
    assert (reasoning, content, stopped) == ("I should greet.", "Hello there! ", True)


def test_choice_text_takes_its_stop_strings_from_the_check_only():
    tok = TextTokenizer.demo(512)
    with pytest.raises(ValueError, match="StopCheck"):
        ChoiceText(StopCheck(tok.detokenizer([]), ["a"]), ["b"])
