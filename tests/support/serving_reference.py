"""The engine's reference: the model's own greedy decode of each prompt alone (make_step, batch 1)."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np

import jax_sparse_kv as jsk
from jax_sparse_kv import nn as jnn

PAGE = 8


def one_bucket(kwargs: dict) -> dict:
    """`kwargs` of an `Engine` whose steps pad to one token and one sequence bucket (the largest, its
    ``max_tokens_per_step`` / ``max_seqs``) and whose decode steps run that bucket's mixed program
    (``decode_programs=False``) unless they name theirs: `make_engine`'s engine compiles one step program
    instead of 9 (36 with 3 n-gram drafts on CPU: the default powers of two, decode-only programs per row
    width); outputs do not depend on either."""
    import inspect

    from jax_sparse_kv import serving

    defaults = inspect.signature(serving.Engine).parameters
    out = dict(kwargs)
    tokens = out.get("max_tokens_per_step", defaults["max_tokens_per_step"].default)
    out.setdefault("token_buckets", (tokens,))
    out.setdefault("seq_buckets", (out.get("max_seqs", defaults["max_seqs"].default),))
    out.setdefault("decode_programs", False)
    return out


def make_engine(model: jnn.MiniMaxM3, **overrides):
    """The serving tests' engine: 64 pages of `PAGE` tokens, f32 pools, 4 sequences, 16 tokens a step.

    Its steps are padded to one token and one sequence bucket, decode steps in the mixed program (`one_bucket`);
    ``token_buckets=None, seq_buckets=None, decode_programs=True`` asks for the engine's default programs."""
    from jax_sparse_kv import serving

    kwargs = dict(
        num_pages=64, page_size=PAGE, dtype=jnp.float32, max_seqs=4, max_tokens_per_step=16, max_model_len=160
    )
    kwargs.update(overrides)
    return serving.Engine(model, **one_bucket(kwargs))


def assert_idle(engine) -> None:
    """No request left in `engine`; every page free or cached; the page books balance."""
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.free_pages + stats.cached_pages == stats.num_pages
    engine.kv.check()


class SoloGreedy:
    """Greedy decode of one prompt at a time through `make_step`; prompts padded to one width (one program)."""

    def __init__(self, model: jnn.MiniMaxM3, width: int = 96, max_len: int = 160, dtype=jnp.float32, kv_scale=1.0):
        self.model = model
        self.width = width
        self.pages = -(-max_len // PAGE)
        self.layout = model.config.layout(num_slots=self.pages * PAGE, page_size=PAGE, dtype=dtype)
        self.step = jnn.make_step(model, kv_scale=kv_scale)
        self.table = jnp.arange(1, self.pages + 1, dtype=jnp.int32)[None]
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt, steps: int) -> list[int]:
        key = tuple(int(t) for t in prompt)
        have = self._memo.get(key, [])
        if len(have) < steps:
            have = self._run(key, steps)
            self._memo[key] = have
        return have[:steps]

    def _run(self, prompt: tuple[int, ...], steps: int) -> list[int]:
        n = len(prompt)
        assert n <= self.width and n + steps <= self.pages * PAGE
        cache = jsk.SparseKVCache.zeros(self.layout)
        tokens = np.zeros((1, self.width), np.int32)
        positions = np.full((1, self.width), -1, np.int32)
        tokens[0, :n], positions[0, :n] = prompt, np.arange(n)
        logits, cache = self.step(jnp.asarray(tokens), jnp.asarray(positions), cache, self.table)
        token = int(jnp.argmax(logits[0, n - 1]))
        out = [token]
        for i in range(steps - 1):
            logits, cache = self.step(jnp.asarray([[token]]), jnp.asarray([[n + i]]), cache, self.table)
            token = int(jnp.argmax(logits[0, 0]))
            out.append(token)
        return out


_SOLOS: dict[int, tuple[jnn.MiniMaxM3, SoloGreedy]] = {}


def solo_greedy(model: jnn.MiniMaxM3) -> SoloGreedy:
    """One `SoloGreedy` (f32 pools) per model for the whole session: its programs and memo serve every test."""
    entry = _SOLOS.get(id(model))
    if entry is None or entry[0] is not model:
        entry = _SOLOS[id(model)] = (model, SoloGreedy(model))
    return entry[1]


FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "m3")


@functools.cache
def fixture_model(spelling: str = "flat") -> jnn.MiniMaxM3:
    """The tiny random M3 of tests/fixtures/m3 (weights wide enough for sharp greedy choices), transformers' tokens
    recorded in reference.npz."""
    return jnn.MiniMaxM3.from_pretrained(os.path.join(FIXTURES, spelling))


def transformers_reference() -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(FIXTURES, "reference.npz")))


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]
