"""Structured outputs: constrained decoding with llguidance (JSON schema, JSON object, regex, choice, Lark).

What llguidance does here: it compiles a request's constraint (`StructuredOutput`) into a grammar and, for
each decoding step, computes the set of token ids that keep the output a prefix of some string of the
grammar's language (an Earley parser over a lazily built lexer DFA, walked over a trie of the tokenizer's
token bytes). The engine turns that set into a row of a bitmask, masks the logits with `apply_bitmask` in
the jitted step (disallowed tokens at ``-inf``, before sampling, so every sampler sees only allowed tokens),
samples, and feeds the chosen token back with `Matcher.accept`.

Objects, from the longest lived to the shortest:

- `GrammarCompiler` (one per tokenizer; built from a `tokenizers.Tokenizer`, the model's ``vocab_size`` and
  the EOS ids): `GrammarCompiler.compile` turns a `StructuredOutput` into a `Grammar`, cached (LRU) by spec
  and thread-safe, so the server may compile in worker threads and refuse a bad spec with a 400 (`ValueError`).
- `Grammar` (immutable, shared): `Grammar.matcher` gives a fresh `Matcher` (a deep copy of a compiled
  prototype: ~1 us, against ~0.3 ms to build one from the grammar text).
- `Matcher` (one per request, used by one thread): `fill_bitmask`, `accept`, `is_finished`, `rollback`,
  `reset`. `fill_bitmasks` fills many rows at once on llguidance's thread pool.

Bitmask layout (llguidance's, which vLLM uses too): int32 ``[rows, ceil(vocab_size / 32)]``; token ``t`` is
allowed when bit ``t % 32`` of word ``t // 32`` is set (word ``w`` covers tokens ``32 w .. 32 w + 31``,
least significant bit first). Ids at or past the tokenizer's vocabulary (a model's ``vocab_size`` is often
padded past it) and special tokens other than EOS are never allowed. EOS is allowed exactly when the grammar
may end here; once nothing more may follow (`Matcher.is_finished`), the row allows EOS only. A row of all
ones (`all_allowed`) leaves its logits unchanged, so unconstrained rows share the batch's bitmask.

Costs: the bitmask is computed on the host, per step, per constrained row (`Matcher.fill_bitmask`). Measured
on one CPU core: a few microseconds a row at the demo's 512-token vocabulary; at a synthetic 200K byte-level
vocabulary a median of ~4 us and at most ~0.7 ms a row (the first mask inside a JSON string, where ~180K
tokens are allowed and the token trie is walked; llguidance reuses masks of states it has seen), ~0.1 ms at
JSON punctuation. `fill_bitmasks` spreads rows over threads. `accept` costs 1-50 us. Building the compiler
(llguidance's token trie) takes ~1.7 s at 200K tokens, once per server; compiling a small schema ~1 ms
(huge ones up to hundreds of milliseconds; llguidance releases the GIL), cached. `apply_bitmask` on device
is a few elementwise ops over ``[rows, vocab]``.

Not supported here: llguidance's fast-forward tokens (forced tokens emitted without a model step), structural
tags (constraints that start at a trigger in free text, e.g. tool calls), masks for speculative draft tokens
(llguidance has them: ``LLExecutor.unsafe_compute_mask_ptr_with_draft_token``; `Matcher.rollback` is here),
and JSON-schema keywords llguidance does not implement (the compile error says which). With
``whitespace_flexible`` (the default, as in vLLM) a JSON output may contain runs of
whitespace between tokens; ``max_tokens`` bounds them, ``whitespace_flexible=False`` forbids them.

llguidance is an optional dependency (``pip install 'jax_sparse_kv[structured]'``): this module imports
without it; building a compiler or validating a spec raises `ImportError` saying so.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "StructuredOutput",
    "GrammarCompiler",
    "Grammar",
    "Matcher",
    "apply_bitmask",
    "all_allowed",
    "allocate_bitmask",
    "bitmask_words",
    "fill_bitmasks",
]

logger = logging.getLogger(__name__)

_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "structured outputs need llguidance: pip install 'jax_sparse_kv[structured]' (llguidance>=1.9)"
        ) from e
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def all_allowed(words: int) -> np.ndarray:
    """A neutral bitmask row (every token allowed): int32 ``[words]`` of -1 (all bits set)."""
    return np.full(words, -1, np.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """An int32 ``[rows, ceil(vocab_size / 32)]`` bitmask, every row neutral (all tokens allowed)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)


def apply_bitmask(logits: jnp.ndarray, bitmask: jnp.ndarray) -> jnp.ndarray:
    """Logits with the tokens a bitmask disallows at ``-inf``.

    Args:
      logits: ``[..., vocab]`` (any float dtype; kept).
      bitmask: int32 ``[..., words]`` with ``32 * words >= vocab`` (bit ``t % 32`` of word ``t // 32``: token
        ``t`` allowed; bits past ``vocab`` are ignored).

    Static shapes, no loop over the vocabulary: the words are unpacked with one broadcast shift. A row of all
    ones returns its logits unchanged.
    """
    vocab = logits.shape[-1]
    words = bitmask.shape[-1]
    if words * 32 < vocab:
        raise ValueError(f"a bitmask of {words} words covers {words * 32} tokens, fewer than the logits' {vocab}")
    if bitmask.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"bitmask {bitmask.shape} and logits {logits.shape} differ in their leading dimensions")
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask.astype(jnp.int32)[..., None] >> shifts) & 1  # [..., words, 32]; >> is arithmetic, & 1 is exact
    allowed = bits.reshape(*bitmask.shape[:-1], words * 32)[..., :vocab] != 0
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, logits.dtype))


# ---------------------------------------------------------------------------------------------- the spec


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request constrains its output to: exactly one of the five fields.

    Attributes:
      json: a JSON schema, as a dict or as JSON text (OpenAI's ``response_format`` ``json_schema``).
      json_object: any JSON object (OpenAI's ``response_format`` ``{"type": "json_object"}``).
      regex: a regular expression the whole output matches (Rust ``regex`` syntax, anchored at both ends).
      choice: one of these strings, exactly.
      grammar: a Lark grammar in llguidance's dialect (a ``start`` rule; see llguidance's docs/syntax.md);
        GBNF (``root ::= ...``) is converted.
      whitespace_flexible: for ``json`` / ``json_object``: allow whitespace between JSON tokens (True, the
        default) or emit compact JSON (False; separators ``,`` and ``:``).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = True

    def __hash__(self) -> int:  # dict and list fields: hash the canonical key instead
        try:
            return hash(self.key())
        except ValueError:
            return hash(tuple(repr(getattr(self, f)) for f in _FIELDS))

    @property
    def kind(self) -> str:
        """The field that is set (`ValueError` unless exactly one is)."""
        return self._check_fields()

    def _set_fields(self) -> list[str]:
        return [f for f in _FIELDS if (self.json_object if f == "json_object" else getattr(self, f) is not None)]

    def _schema(self) -> dict:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json: the schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json: a JSON schema must be a JSON object, not {type(schema).__name__}")
        return schema

    def _check_fields(self) -> str:
        """The field that is set, after the checks that need no llguidance."""
        set_fields = self._set_fields()
        if not set_fields:
            raise ValueError(f"structured output: none of {', '.join(_FIELDS)} is set; set exactly one")
        if len(set_fields) > 1:
            raise ValueError(f"structured output: set exactly one of {', '.join(_FIELDS)}, not {', '.join(set_fields)}")
        kind = set_fields[0]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object: must be a bool, not {type(self.json_object).__name__}")
        if kind == "json":
            if not isinstance(self.json, dict | str):
                raise ValueError(f"json: a JSON schema is a dict or JSON text, not {type(self.json).__name__}")
            self._schema()
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str):
                raise ValueError(f"{kind}: must be a string, not {type(value).__name__}")
            if kind == "grammar" and not value.strip():
                raise ValueError("grammar: the grammar is empty")
        elif kind == "choice":
            if isinstance(self.choice, str | bytes) or not isinstance(self.choice, Sequence):
                raise ValueError(f"choice: must be a list of strings, not {type(self.choice).__name__}")
            if not self.choice:
                raise ValueError("choice: the list of choices is empty")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise ValueError(f"choice: every choice must be a string, not {bad[0]!r}")
        return kind

    def key(self) -> tuple:
        """A hashable canonical form (the compile cache's key): a schema as a dict or as text is one key."""
        kind = self._check_fields()
        if kind == "json":
            value: Any = json.dumps(self._schema(), sort_keys=True, separators=(",", ":"))
        elif kind == "json_object":
            value = True
        elif kind == "choice":
            value = tuple(self.choice)
        else:
            value = getattr(self, kind)
        flexible = self.whitespace_flexible if kind in ("json", "json_object") else None
        return (kind, value, flexible)

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON serialization) of this spec; `ValueError` if a field is malformed.

        Not yet compiled: llguidance may still refuse it (see `validate`).
        """
        kind = self._check_fields()
        llg = _llguidance()
        try:
            if kind in ("json", "json_object"):
                schema = self._schema() if kind == "json" else {"type": "object"}
                options = {"whitespace_flexible": bool(self.whitespace_flexible)}
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return llg.grammar_from("choice", list(self.choice))
            return llg.grammar_from("grammar", self.grammar)  # Lark as is, GBNF converted
        except ValueError as e:
            raise ValueError(f"{kind}: {e}") from None

    def validate(self) -> None:
        """Raises `ValueError` naming the field: none or several set, a schema that is not JSON or not an
        object, an empty choice list, or a constraint llguidance refuses (its message included)."""
        kind = self._check_fields()
        text = self.grammar_text()
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, None)
        if is_error:
            raise ValueError(f"{kind}: {_message(messages)}")


def _message(messages: Sequence[str] | str) -> str:
    text = messages if isinstance(messages, str) else "; ".join(messages)
    return text.strip() or "refused by llguidance"


# ---------------------------------------------------------------------------------------------- compiling


class GrammarCompiler:
    """Compiles `StructuredOutput` specs against one tokenizer; one per served model, shared by threads.

    Args:
      tokenizer: a `tokenizers.Tokenizer` (e.g. `TextTokenizer.tokenizer`), byte-level BPE or byte-fallback.
      vocab_size: the model's vocabulary (logits' last dimension): at least the tokenizer's; ids past the
        tokenizer's are never allowed.
      eos_token_ids: the ids that end a generation; allowed exactly when the grammar may end.
      cache_size: grammars kept (least recently used evicted).
      limits: an ``llguidance.LLParserLimits`` (None: llguidance's defaults); a grammar past them fails to
        compile or, mid-generation, ends its matcher with an error (`Matcher.error`).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        limits: Any = None,
    ):
        llg = _llguidance()
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos:
            raise ValueError("eos_token_ids: structured outputs need at least one EOS id to end a grammar")
        tokenizer_vocab = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if vocab_size < tokenizer_vocab:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids")
        if any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids {eos} are not all ids below vocab_size {vocab_size}")
        plain = copy.copy(tokenizer)  # llguidance re-reads the JSON: without padding / truncation settings
        plain.no_padding()
        plain.no_truncation()
        self.ll_tokenizer = llg.LLTokenizer(plain.to_str(), n_vocab=vocab_size, eos_token=list(eos))
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.eos_token_ids = eos
        self.cache_size = cache_size
        self._limits = limits
        self._cache: collections.OrderedDict[tuple, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_text_tokenizer(cls, text_tokenizer: Any, vocab_size: int | None = None, **kwargs: Any) -> GrammarCompiler:
        """From the server's `TextTokenizer` (its ``tokenizer`` and ``eos_token_ids``)."""
        vocab = text_tokenizer.vocab_size if vocab_size is None else vocab_size
        return cls(text_tokenizer.tokenizer, vocab, text_tokenizer.eos_token_ids, **kwargs)

    def compile(self, spec: StructuredOutput) -> Grammar:
        """The `Grammar` of `spec` (the same object for an equal spec while cached); `ValueError` naming the
        field if the spec is malformed or llguidance refuses it."""
        key = spec.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._build(spec, key)  # outside the lock: llguidance releases the GIL while compiling
        with self._lock:
            grammar = self._cache.setdefault(key, grammar)  # a racing thread's copy wins: one object per key
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: StructuredOutput, key: tuple) -> Grammar:
        llg = _llguidance()
        text = spec.grammar_text()
        kwargs = {} if self._limits is None else {"limits": self._limits}
        prototype = llg.LLMatcher(self.ll_tokenizer, text, log_level=0, **kwargs)
        if prototype.is_error():
            raise ValueError(f"{key[0]}: {_message(prototype.get_error())}")
        warnings = tuple(prototype.get_grammar_warnings())
        for warning in warnings:
            logger.warning("structured output %s: %s", key[0], warning)
        return Grammar(self, spec, text, prototype, warnings)

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._cache), "max_size": self.cache_size}


class Grammar:
    """A compiled constraint (immutable; shared by every request with an equal spec)."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutput, text: str, prototype: Any, warnings=()):
        self.compiler = compiler
        self.spec = spec
        self.text = text  # llguidance's serialized grammar
        self.warnings = warnings
        self._prototype = prototype  # never advanced: matchers are deep copies of it

    def matcher(self) -> Matcher:
        """A fresh `Matcher` at the start of the grammar."""
        return Matcher(self._prototype.deep_copy(), self.compiler)


class Matcher:
    """One request's position in its grammar. Not thread-safe: one engine thread drives it."""

    def __init__(self, ll_matcher: Any, compiler: GrammarCompiler):
        self._m = ll_matcher
        self.vocab_size = compiler.vocab_size
        self.words = compiler.words
        self._eos = frozenset(compiler.eos_token_ids)
        self._consumed = 0  # tokens llguidance has consumed (what it can roll back)
        self._ended = False  # an EOS was accepted: nothing more is
        self._eos_after_stop = False  # ... once the grammar had already ended: llguidance does not count that EOS

    def fill_bitmask(self, out: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into ``out[row]`` (``out``: int32 ``[rows, ceil(vocab_size / 32)]``,
        C-contiguous). Once `is_finished`, only EOS is allowed."""
        dst = _check_bitmask(out, self.words)[row]
        self._m.unsafe_compute_mask_ptr(dst.ctypes.data, dst.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) if the grammar does not allow it here."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size or self._ended:  # (an id past the vocabulary breaks llguidance)
            return False
        if token_id in self._eos and self._m.is_stopped() and not self._m.is_error():
            self._ended = self._eos_after_stop = True  # the EOS of a grammar that already ended (its mask allows it)
            return True
        if self._m.try_consume_tokens([token_id]) != 1:  # unlike consume_token, no error state on refusal
            return False
        self._consumed += 1
        self._ended = token_id in self._eos
        return True

    def is_finished(self) -> bool:
        """True once nothing more may follow: the grammar ended (stop the request: finish reason "stop"), EOS
        was accepted, or the matcher failed (`error` says why; the mask then allows only EOS)."""
        return self._ended or self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (e.g. a parser limit hit mid-generation), or None."""
        return (self._m.get_error() or "failed") if self._m.is_error() else None

    @property
    def num_accepted(self) -> int:
        return self._consumed + self._eos_after_stop

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        if num_tokens:
            self._ended = False  # the EOS, if any, was the last token
        if num_tokens and self._eos_after_stop:
            self._eos_after_stop = False
            num_tokens -= 1
        if num_tokens:
            if not self._m.rollback(num_tokens):
                raise RuntimeError(f"llguidance failed to roll back {num_tokens} tokens: {self._m.get_error()}")
            self._consumed -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar (e.g. a preempted request recomputed from scratch)."""
        if not self._m.reset():
            raise RuntimeError(f"llguidance failed to reset the matcher: {self._m.get_error()}")
        self._consumed = 0
        self._ended = self._eos_after_stop = False


def _check_bitmask(out: np.ndarray, words: int) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words:
        raise ValueError(f"the bitmask must be an int32 NumPy array [rows, {words}], not {getattr(out, 'shape', out)}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("the bitmask must be C-contiguous and writeable")
    return out


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool, made on first use (one per process; `functools.cache` is thread-safe enough:
    two threads racing make two pools, one of which is dropped)."""
    return _llguidance().LLExecutor()


def fill_bitmasks(rows: Sequence[tuple[Matcher, int]], out: np.ndarray) -> None:
    """`Matcher.fill_bitmask` for many ``(matcher, row)`` pairs at once, on llguidance's thread pool (its
    ``LLExecutor``: up to 80% of the CPUs, at most 32). The matchers must share ``out``'s vocabulary."""
    if not rows:
        return
    words = rows[0][0].words
    _check_bitmask(out, words)
    for matcher, row in rows:
        if matcher.words != words or not 0 <= row < out.shape[0]:
            raise ValueError(f"row {row} of a [{out.shape[0]}, {words}] bitmask, matcher of {matcher.words} words")
    _executor().unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], out.ctypes.data, words * 4, out.shape[0])
