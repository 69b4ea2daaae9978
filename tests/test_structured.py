"""Structured outputs (jax_sparse_kv.serving.structured): llguidance matchers driven by simulated sampling,
the bitmask on device, spec validation and the compile cache."""

from __future__ import annotations

import json
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

from jax_sparse_kv.server.tokenizer import TextTokenizer  # noqa: E402
from jax_sparse_kv.serving.structured import (  # noqa: E402
    GrammarCompiler,
    StructuredOutput,
    all_allowed,
    allocate_bitmask,
    apply_bitmask,
    bitmask_words,
    fill_bitmasks,
)

TOKENIZER_VOCAB = 512
VOCAB = 530  # the model's vocabulary: past the tokenizer's, and not a multiple of 32
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.demo(TOKENIZER_VOCAB)


@pytest.fixture(scope="module")
def eos(tok):
    (eos,) = tok.eos_token_ids
    return eos


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.tokenizer, VOCAB, tok.eos_token_ids)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    bits = (row[:, None] >> np.arange(32, dtype=np.int32)) & 1  # [words, 32], bit t % 32 of word t // 32
    return np.flatnonzero(bits.reshape(-1))


def next_allowed(matcher) -> np.ndarray:
    out = np.zeros((1, bitmask_words(VOCAB)), np.int32)
    matcher.fill_bitmask(out, 0)
    return allowed_ids(out[0])


def generate(compiler, tok, eos, spec, complete, seed, max_steps=400):
    """Samples allowed tokens (seeded; closing characters favoured so that outputs end) until the matcher
    finishes. Checks at every step that EOS is allowed exactly when `complete(text so far)`; returns the text."""
    matcher = compiler.compile(spec).matcher()
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(max_steps):
        allowed = next_allowed(matcher)
        assert allowed.size and allowed.max() < TOKENIZER_VOCAB  # ids past the tokenizer's are never allowed
        text = compiler.ll_tokenizer.decode_bytes(ids)
        assert (eos in allowed) == complete(text), (text, eos in allowed)
        if matcher.is_finished():
            assert list(allowed) == [eos]  # nothing may follow: EOS only
            break
        closers = [t for t in allowed if t == eos or any(c in tok.token_text(int(t)) for c in '"}])')]
        token = int(rng.choice(closers) if closers and rng.random() < 0.5 else rng.choice(allowed))
        assert matcher.accept(token)
        if token == eos:
            assert matcher.is_finished()
            break
        ids.append(token)
    else:
        raise AssertionError(f"no end after {max_steps} tokens: {compiler.ll_tokenizer.decode_bytes(ids)!r}")
    assert not matcher.accept(tok.token_id("a"))  # nothing but EOS once finished
    return text.decode("utf-8")


def loads(text: bytes):
    try:
        return json.loads(text)
    except ValueError:
        return None


def matches_schema(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and isinstance(value["city"], str)
        and isinstance(value["days"], int)
        and not isinstance(value["days"], bool)
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spec_json", [SCHEMA, json.dumps(SCHEMA)])
def test_json_schema(compiler, tok, eos, spec_json, seed):
    spec = StructuredOutput(json=spec_json)
    text = generate(compiler, tok, eos, spec, lambda t: matches_schema(loads(t)), seed)
    assert matches_schema(json.loads(text))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object(compiler, tok, eos, seed):
    text = generate(compiler, tok, eos, StructuredOutput(json_object=True), lambda t: isinstance(loads(t), dict), seed)
    assert isinstance(json.loads(text), dict)


def test_regex(compiler, tok, eos):
    pattern = "[0-9]{3}-[a-z]{2}"
    text = generate(
        compiler, tok, eos, StructuredOutput(regex=pattern), lambda t: bool(re.fullmatch(pattern, t.decode())), 0
    )
    assert re.fullmatch(pattern, text)


@pytest.mark.parametrize("seed", range(3))
def test_choice(compiler, tok, eos, seed):
    choices = ["red", "green", "blue", "re"]  # "re": EOS allowed mid-way through "red", not yet finished
    text = generate(compiler, tok, eos, StructuredOutput(choice=choices), lambda t: t.decode() in choices, seed)
    assert text in choices


@pytest.mark.parametrize("seed", range(2))
def test_lark_grammar(compiler, tok, eos, seed):
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/\n'
    full = re.compile(r"\([0-9]{1,3}(,[0-9]{1,3})*\)")
    text = generate(
        compiler, tok, eos, StructuredOutput(grammar=grammar), lambda t: bool(full.fullmatch(t.decode())), seed
    )
    assert full.fullmatch(text)


def test_eos_only_at_the_end_and_after(compiler, tok, eos):
    matcher = compiler.compile(StructuredOutput(regex="[0-9]{3}-[a-z]{2}")).matcher()
    for t in tok.encode("123-a", add_special_tokens=False):
        assert eos not in next_allowed(matcher)
        assert matcher.accept(t)
    assert not matcher.accept(eos) and not matcher.is_finished()  # refused: the state is unchanged
    assert matcher.accept(tok.token_id("b"))
    assert matcher.is_finished() and list(next_allowed(matcher)) == [eos]
    assert matcher.accept(eos)  # the engine may still sample the EOS its mask allows
    assert matcher.is_finished() and not matcher.accept(eos)


def test_disallowed_token(compiler, tok, eos):
    matcher = compiler.compile(StructuredOutput(regex="[0-9]{3}-[a-z]{2}")).matcher()
    before = next_allowed(matcher)
    assert tok.token_id("a") not in before
    assert not matcher.accept(tok.token_id("a"))
    assert not matcher.accept(VOCAB + 5) and not matcher.accept(TOKENIZER_VOCAB + 1) and not matcher.accept(-1)
    assert matcher.error is None and np.array_equal(next_allowed(matcher), before)  # still usable
    assert matcher.accept(tok.token_id("1"))


def test_rollback_and_reset(compiler, tok, eos):
    matcher = compiler.compile(StructuredOutput(regex="[0-9]{3}-[a-z]{2}")).matcher()
    ids = tok.encode("123-ab", add_special_tokens=False)
    masks = []
    for t in ids:
        masks.append(next_allowed(matcher))
        assert matcher.accept(t)
    assert matcher.is_finished() and matcher.accept(eos) and matcher.num_accepted == len(ids) + 1
    matcher.rollback(1)  # the EOS (llguidance never counted it: the grammar had already ended)
    assert matcher.is_finished() and matcher.num_accepted == len(ids)
    matcher.rollback(2)
    assert not matcher.is_finished() and np.array_equal(next_allowed(matcher), masks[-2])
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(len(ids))
    matcher.reset()
    assert matcher.num_accepted == 0 and np.array_equal(next_allowed(matcher), masks[0])
    # an EOS that llguidance consumes (the grammar could go on) rolls back too
    matcher = compiler.compile(StructuredOutput(choice=["re", "red"])).matcher()
    for t in tok.encode("re", add_special_tokens=False):
        assert matcher.accept(t)
    assert not matcher.is_finished() and matcher.accept(eos) and matcher.is_finished()
    matcher.rollback(1)
    assert not matcher.is_finished() and tok.token_id("d") in next_allowed(matcher)


def test_fill_bitmasks(compiler, tok):
    a = compiler.compile(StructuredOutput(json=SCHEMA)).matcher()
    b = compiler.compile(StructuredOutput(regex="[0-9]{3}-[a-z]{2}")).matcher()
    assert a.accept(tok.token_id("{"))
    out = allocate_bitmask(3, VOCAB)
    fill_bitmasks([(a, 0), (b, 2)], out)
    assert np.array_equal(allowed_ids(out[0]), next_allowed(a)) and np.array_equal(allowed_ids(out[2]), next_allowed(b))
    assert np.array_equal(out[1], all_allowed(out.shape[1]))
    with pytest.raises(ValueError, match="int32"):
        a.fill_bitmask(np.zeros((1, 3), np.int32), 0)


def test_whitespace_flexible(compiler, tok):
    space, brace = tok.token_id("Ġ"), tok.token_id("{")  # byte-level BPE spells " " as "Ġ"
    for flexible in (True, False):
        matcher = compiler.compile(StructuredOutput(json_object=True, whitespace_flexible=flexible)).matcher()
        assert matcher.accept(brace)
        assert (space in next_allowed(matcher)) == flexible


def reference_apply(logits, bitmask):
    t = np.arange(logits.shape[-1])
    allowed = (bitmask[:, t // 32] >> (t % 32)) & 1
    return np.where(allowed == 1, logits, -np.inf)


@pytest.mark.parametrize("vocab", [VOCAB, 512, 33])
def test_apply_bitmask(vocab):
    rng = np.random.default_rng(vocab)
    rows, words = 4, bitmask_words(vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = all_allowed(words)
    bitmask[1] = 0
    got = np.asarray(jax.jit(apply_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(got, reference_apply(logits, bitmask))
    np.testing.assert_array_equal(got[0], logits[0])  # all ones: unchanged
    assert np.all(got[1] == -np.inf)
    half = apply_bitmask(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(bitmask))
    assert half.dtype == jnp.bfloat16 and np.array_equal(np.isinf(np.asarray(half, np.float32)), np.isinf(got))
    with pytest.raises(ValueError, match="covers"):
        apply_bitmask(logits, bitmask[:, :-1])


def test_apply_matcher_bitmask(compiler, tok):
    matcher = compiler.compile(StructuredOutput(json_object=True)).matcher()
    for t in tok.encode('{"', add_special_tokens=False):
        assert matcher.accept(t)
    out = allocate_bitmask(2, VOCAB)
    matcher.fill_bitmask(out, 1)
    logits = np.random.default_rng(0).standard_normal((2, VOCAB)).astype(np.float32)
    got = np.asarray(jax.jit(apply_bitmask)(logits, out))
    np.testing.assert_array_equal(got[0], logits[0])
    allowed = np.flatnonzero(np.isfinite(got[1]))
    np.testing.assert_array_equal(allowed, next_allowed(matcher))
    assert allowed.size > 100 and np.all(got[1, TOKENIZER_VOCAB:] == -np.inf)  # inside a string: most tokens


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput(), "none of json, json_object, regex, choice, grammar is set"),
        (StructuredOutput(json=SCHEMA, regex="a"), "not json, regex"),
        (StructuredOutput(json_object=True, choice=["a"]), "not json_object, choice"),
        (StructuredOutput(json="{not json"), "^json: the schema is not valid JSON"),
        (StructuredOutput(json="[1, 2]"), "^json: a JSON schema must be a JSON object"),
        (StructuredOutput(json={"type": "no-such-type"}), "(?s)^json: .*no-such-type"),
        (StructuredOutput(choice=[]), "^choice: the list of choices is empty"),
        (StructuredOutput(choice=["a", 1]), "^choice: every choice must be a string"),
        (StructuredOutput(regex="["), "(?s)^regex: .*unclosed character class"),
        (StructuredOutput(grammar="start: foo"), '(?s)^grammar: .*unknown name: "foo"'),
        (StructuredOutput(grammar="  "), "^grammar: the grammar is empty"),
    ],
)
def test_validation_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compile_cache(tok):
    compiler = GrammarCompiler(tok.tokenizer, VOCAB, tok.eos_token_ids, cache_size=2)
    first = compiler.compile(StructuredOutput(json=SCHEMA))
    assert compiler.compile(StructuredOutput(json=dict(SCHEMA))) is first
    assert compiler.compile(StructuredOutput(json=json.dumps(SCHEMA, indent=2))) is first  # same schema as text
    assert compiler.compile(StructuredOutput(json=SCHEMA, whitespace_flexible=False)) is not first
    assert hash(StructuredOutput(choice=["a", "b"])) == hash(StructuredOutput(choice=("a", "b")))
    compiler.compile(StructuredOutput(regex="x"))  # evicts the least recently used (the first)
    assert compiler.cache_info() == {"size": 2, "max_size": 2}
    assert compiler.compile(StructuredOutput(json=SCHEMA)) is not first
    spec, results = StructuredOutput(regex="[a-z]+@[a-z]+"), []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(g is results[0] for g in results)
    matcher = results[0].matcher()  # compiled in another thread, used in this one
    assert matcher.accept(tok.token_id("a")) and tok.token_id("@") in next_allowed(matcher)


def test_compiler_arguments(tok):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tok.tokenizer, TOKENIZER_VOCAB - 1, tok.eos_token_ids)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarCompiler(tok.tokenizer, VOCAB, ())
    compiler = GrammarCompiler.from_text_tokenizer(tok)
    assert compiler.vocab_size == TOKENIZER_VOCAB and compiler.words == 16
