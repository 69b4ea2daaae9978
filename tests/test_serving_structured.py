"""Structured outputs in the engine: the grammar's mask applied on device, the request stopped when it is complete.

A random demo model (512 tokens) with the demo tokenizer: whatever the model prefers, a constrained request's
text must parse (JSON schema, JSON object, regex, choice), greedy or sampled; the constraint may wait for the
end of a reasoning block; speculation leaves constrained requests alone.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

from support.serving_reference import one_bucket

from jax_sparse_kv.nn import MiniMaxM3, demo_config  # noqa: E402
from jax_sparse_kv.server.tokenizer import TextTokenizer  # noqa: E402
from jax_sparse_kv.serving import Engine, NgramSpeculation, SamplingParams  # noqa: E402
from jax_sparse_kv.serving.structured import GrammarCompiler, StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup():
    tok = TextTokenizer.demo(512)
    model = MiniMaxM3(demo_config(), seed=0)
    eos = tok.eos_token_ids
    compiler = GrammarCompiler(tok.tokenizer, model.config.vocab_size, eos)
    engine = Engine(
        model,
        num_pages=64,
        page_size=16,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=64)),
        grammar_compiler=compiler,
    )
    return tok, model, compiler, engine


def run(engine: Engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def text_of(tok: TextTokenizer, out) -> str:
    return tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "temperature",
    [pytest.param(0.0, marks=pytest.mark.slow), 1.0],  # 0.0: an engine run of its own; sampled JSON (1.0) stays
)
def test_json_schema_outputs_parse_and_follow_the_schema(setup, temperature):
    tok, _, _, engine = setup
    for seed in range(3):
        params = SamplingParams(
            max_tokens=80,
            temperature=temperature,
            seed=seed,
            structured_outputs=StructuredOutput(json=SCHEMA, whitespace_flexible=False),
        )
        out = run(engine, tok.encode("Weather please:"), params)
        value = json.loads(text_of(tok, out))
        assert set(value) == {"city", "days"} and isinstance(value["city"], str) and 0 <= value["days"] <= 99
        assert out.finish_reason == "stop"


def test_regex_choice_and_json_object(setup):
    tok, _, _, engine = setup
    prompt = tok.encode("Answer:")
    out = run(
        engine,
        prompt,
        SamplingParams(
            max_tokens=20, temperature=1.0, seed=1, structured_outputs=StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}")
        ),
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_of(tok, out)), text_of(tok, out)
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        out = run(
            engine,
            prompt,
            SamplingParams(
                max_tokens=10, temperature=1.0, seed=seed, structured_outputs=StructuredOutput(choice=choices)
            ),
        )
        assert text_of(tok, out) in choices
    stopped = 0  # a random model may wander inside a string until max_tokens; every output that ends parses
    for seed in range(4):
        out = run(
            engine,
            prompt,
            SamplingParams(
                max_tokens=60,
                temperature=1.0,
                seed=seed,
                structured_outputs=(StructuredOutput(json_object=True, whitespace_flexible=False)),
            ),
        )
        if out.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text_of(tok, out)), dict), text_of(tok, out)
        else:
            assert text_of(tok, out).startswith("{")
    assert stopped >= 1


@pytest.mark.slow  # ~8 s: an engine of its own
def test_the_constraint_waits_for_the_end_of_reasoning(setup):
    """A logit bias forces the reasoning-end token first (unconstrained then); the rest follows the regex."""
    tok, _, _, engine = setup
    end = tok.token_id("</think>")
    params = SamplingParams(
        max_tokens=20,
        logit_bias={end: 100.0},
        reasoning_end_token_id=end,
        structured_outputs=StructuredOutput(regex=r"ok [a-z]{3}"),
    )
    out = run(engine, tok.encode("Think first."), params)
    assert out.token_ids[0] == end
    assert re.fullmatch(r"ok [a-z]{3}", tok.decode(out.token_ids[1:])), tok.decode(out.token_ids[1:])
    unconstrained = run(engine, tok.encode("Think first."), SamplingParams(max_tokens=5, logit_bias={end: 100.0}))
    assert unconstrained.token_ids == [end] * 5  # the same bias without a grammar: the bias alone decides


@pytest.mark.slow  # an engine of its own
def test_speculation_leaves_constrained_requests_alone(setup):
    tok, model, compiler, _ = setup
    engine = Engine(
        model,
        num_pages=64,
        page_size=16,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=64)),
        speculative=NgramSpeculation(num_tokens=3),
        grammar_compiler=compiler,
    )
    params = SamplingParams(max_tokens=60, structured_outputs=StructuredOutput(json=SCHEMA, whitespace_flexible=False))
    out = run(engine, tok.encode('{"city": "Paris", "days": 3} again:'), params)
    assert set(json.loads(text_of(tok, out))) == {"city", "days"}
    assert engine.stats().spec_draft_tokens == 0


def test_structured_requests_need_a_compiler_and_a_valid_grammar(setup):
    tok, model, _, engine = setup
    plain = Engine(model, num_pages=8, page_size=16, max_tokens_per_step=16)
    params = SamplingParams(structured_outputs=StructuredOutput(regex="a+"))
    with pytest.raises(ValueError, match="grammar_compiler"):
        plain.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match="regex"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutput(regex="(unclosed")))
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutput"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs="json"))
    assert not engine.has_unfinished_requests()
