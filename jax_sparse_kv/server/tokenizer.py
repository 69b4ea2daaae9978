"""Text <-> token ids for the server: ``tokenizer.json``, incremental detokenization, the chat template.

- `TextTokenizer.from_dir(DIR)` reads ``DIR/tokenizer.json`` (the `tokenizers` package) and the chat
  template and special tokens from ``DIR/tokenizer_config.json`` (or ``DIR/chat_template.jinja``).
- `TextTokenizer.demo(vocab_size)` builds a byte-level BPE tokenizer of exactly ``vocab_size`` ids with a
  ChatML-style template, for the demo's random model (no download, the same on every machine).
- `IncrementalDetokenizer` turns token ids into text as they arrive. Each call decodes a short window
  (a few tokens already shown plus the new ones) and emits what the new tokens add, holding back text
  that ends in an incomplete UTF-8 sequence; a window keeps tokenizers' context-dependent decoding
  (leading spaces, byte fallback) right. The server builds streamed and non-streamed text from the same
  deltas, so the two are equal by construction.
- `render_chat_template` renders a Hugging Face chat template the way transformers'
  ``apply_chat_template`` does: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension, ``tojson`` (non-ASCII kept), ``raise_exception`` and ``strftime_now``,
  and the special tokens (``bos_token``, ``eos_token``, ...) as variables.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TextTokenizer", "IncrementalDetokenizer", "render_chat_template", "DEMO_CHAT_TEMPLATE"]

#: The demo tokenizer's template: ChatML (``<|im_start|>role\ncontent<|im_end|>\n``).
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEMO_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEMO_ADDED_TOKENS = ("<think>", "</think>")  # ordinary text when decoded, as in reasoning models

# Text the demo tokenizer's merges are learned from (any text would do; this one is fixed so the
# tokenizer is the same everywhere).
_DEMO_CORPUS = """
The cache keeps keys and values for every attention layer of the model. Dense layers read all of their
pages; sparse layers ask a small indexer which blocks matter and read only those. A request arrives with a
prompt, the scheduler gives it pages, the engine runs one step for many requests at once, and each new token
goes back to the client that asked for it. When the cache is full, the engine preempts a request, frees its
pages and computes it again later; nothing is lost and the output does not change.
Hello, world! How are you today? I am fine, thank you. What would you like to know about the weather,
the news, music, books, science or history? Let me think about that for a moment before I answer.
Once upon a time there was a small town by the sea. People there worked on boats, in shops and in the
fields, and in the evening they told each other stories about the stars, the wind and the long winter.
numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 and code: def main(): return print("hello") if x else None
"""


def _special(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the chat template and special tokens the server needs.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      chat_template: a jinja2 chat template, or None (chat requests are then refused).
      special_tokens: template variables such as ``bos_token`` / ``eos_token`` (strings).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None, special_tokens: Mapping[str, str] = ()):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

    # ------------------------------------------------------------ building

    @classmethod
    def from_dir(cls, path: str) -> TextTokenizer:
        """Reads ``path/tokenizer.json`` and, when present, ``tokenizer_config.json`` / ``chat_template.jinja``."""
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise ValueError(f"{path} has no tokenizer.json: the server needs it to turn text into token ids")
        tokenizer = Tokenizer.from_file(file)
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one, else the first
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        specials = {}
        for key, value in config.items():
            if key.endswith("_token") and _special(value) is not None:
                specials[key] = _special(value)
        return cls(tokenizer, template if isinstance(template, str) else None, specials)

    @classmethod
    def demo(cls, vocab_size: int = 512) -> TextTokenizer:
        """A byte-level BPE tokenizer of exactly `vocab_size` ids and a ChatML template (for the demo model)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(DEMO_ADDED_TOKENS),
            special_tokens=list(DEMO_SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(_DEMO_CORPUS.splitlines(), trainer)
        tokenizer.add_tokens(list(DEMO_ADDED_TOKENS))
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size < vocab_size:  # too few merges in the corpus for this size: fill with reserved tokens
            tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - size)])
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size != vocab_size:
            raise ValueError(f"the demo tokenizer has {size} ids, not vocab_size={vocab_size}")
        specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        return cls(tokenizer, DEMO_CHAT_TEMPLATE, specials)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to (a bound for rejecting overlong text before encoding)."""
        longest = max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return max(longest, 4)  # byte-level vocabularies spell bytes as characters: at least one character

    # ------------------------------------------------------------ text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - tokenizers live as long as the server
    def token_text(self, token_id: int) -> str:
        """One token on its own, as text (for logprobs); special tokens included."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The id of ``eos_token`` (from tokenizer_config.json), if the vocabulary has it."""
        eos = self.token_id(self.special_tokens.get("eos_token"))
        return () if eos is None else (eos,)

    def detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool = True, keep: Sequence[str] = ()
    ) -> IncrementalDetokenizer:
        """An `IncrementalDetokenizer`; `keep` names special tokens shown even when skipping the others
        (think tags a checkpoint may declare special, which the reasoning parser must see)."""
        kept = {self.token_id(t) for t in keep} & self.special_ids
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, frozenset(kept))

    # ------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text of a conversation. Raises `ValueError` (no template, or the template refuses it)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json has no chat_template)")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )


class IncrementalDetokenizer:
    """Token ids in, text deltas out; the deltas concatenate to the text of all the ids.

    The prompt's last few ids are the first window's context, so the first generated token decodes as
    it does after the prompt (e.g. with its leading space).
    """

    #: prompt tokens kept as context of the first window
    CONTEXT = 6

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # special tokens to leave out by hand, so that the `keep` ones show (decode skips all or none)
        self._drop = tokenizer.special_ids - keep if skip_special_tokens and keep else frozenset()
        if self._drop:
            self._skip = False
            prompt_ids = [t for t in prompt_ids if t not in self._drop]
        self._ids = list(prompt_ids[-self.CONTEXT :])
        self._prefix = 0  # window start: tokens before it are done
        self._read = len(self._ids)  # tokens before it have been emitted as text

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens add ("" while they end in an incomplete character)."""
        if self._drop:
            token_ids = [t for t in token_ids if t not in self._drop]
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        shown = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        common = _common_prefix(shown, text)
        if len(text) <= common or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]  # keep the window only
        self._read -= self._prefix
        self._prefix = 0
        return text[common:]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD), at the end of the output."""
        if self._read == len(self._ids):
            return ""
        shown = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[_common_prefix(shown, text) :]


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: all of `a` but where new tokens complete a character `a` ends inside."""
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------- chat templates


class TemplateError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``), or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not compile: {e}") from None


def render_chat_template(
    template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
) -> str:
    """Renders `template` over `messages` as transformers' ``apply_chat_template(tokenize=False)`` does."""
    import jinja2

    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as e:
        raise TemplateError(f"the chat template cannot render these messages: {e}") from None
