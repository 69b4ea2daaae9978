"""Prompt logprobs (vLLM's ``prompt_logprobs``; the server's ``echo`` with ``logprobs``, what eval harnesses score).

`PromptScorer` runs the model's cache-free pass over a prompt (its pools' rounding emulated: `KVPrecision` of the
engine's layout) and returns, for every prompt position after the first, the logprob of the prompt's own next
token, its rank, and the most likely tokens with theirs: ``[None, {token_id: logprob, ...}, ...]`` as vLLM's
``RequestOutput.prompt_logprobs``. One jitted program per power-of-two prompt width (at least 16); the LM head
runs on every position: ``width x vocab`` f32 logits on the device (2K tokens of a 200K vocabulary: 1.6 GB).

A second forward of the prompt, beside the engine's prefill: simple and exact, at the cost of one more pass over
the prompt for the requests that ask (eval harnesses' scoring requests, ``max_tokens`` 1). A prompt with images or
videos takes their features (the engine's encoder cache) at its placeholders, as the prefill does: one more program
per width for prompts with images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv.nn.precision import KVPrecision

__all__ = ["PromptScorer", "PromptLogprob"]

#: One prompt position: ``{token_id: (logprob, rank)}`` (the prompt's own token first, then the top ones).
PromptLogprob = dict[int, tuple[float, int]]

#: Smallest prompt width a program is compiled for.
MIN_WIDTH = 16


class PromptScorer:
    """Logprobs of a prompt's own tokens and of the most likely ones, position by position.

    Args:
      model: the engine's `MiniMaxM3` (its parameters are shared, not copied; sharded where the engine's are).
      layout: the engine's cache layout (the pools' dtypes the cache-free pass rounds K/V to).
      kv_scale: the pools' fp8 scale.
      max_logprobs: the most top tokens a request may ask for (a static ``top_k``).
    """

    def __init__(self, model: Any, layout: Any, kv_scale: float, max_logprobs: int):
        graphdef, params = nnx.split(model)
        self._params = params
        self.max_logprobs = max_logprobs
        precision = KVPrecision.of(layout, kv_scale)
        k = max(1, max_logprobs)

        def score(params, tokens, positions, features=None, index=None):
            """tokens, positions ``[W]`` (image ``features [W, hidden]`` at ``index [W]``, -1 for text) -> the next
            token's logprob and rank ``[W]``, the top ``[W, k]``."""
            m = nnx.merge(graphdef, params)
            images = {} if features is None else {"image_features": features, "image_index": index[None]}
            logits = m(tokens[None], positions[None], None, precision=precision, **images)[0][0].astype(jnp.float32)
            lp = jax.nn.log_softmax(logits, axis=-1)  # [W, vocab]
            following = jnp.roll(tokens, -1)  # position i scores the prompt's token i + 1
            own = jnp.take_along_axis(lp, following[:, None], axis=1)[:, 0]
            rank = 1 + jnp.sum(lp > own[:, None], axis=-1)
            top_lp, top_id = jax.lax.top_k(lp, k)
            return own, rank, top_id, top_lp

        self._fn = jax.jit(score)

    def __call__(
        self, prompt: Sequence[int], num: int, images: Sequence[tuple[int, Any]] = ()
    ) -> list[PromptLogprob | None]:
        """``[None] + [{prompt[i + 1]: (logprob, rank), top token: (logprob, rank), ...} for each i]`` (the top
        `num` tokens, ranks 1..num; the prompt's token keeps its own rank). `images`: ``(start, features
        [length, hidden])`` of each image's (or video patch's) placeholder run ``prompt[start : start + length]``."""
        if not 0 <= num <= self.max_logprobs:
            raise ValueError(f"prompt_logprobs must be in [0, {self.max_logprobs}], got {num!r}")
        n = len(prompt)
        width = max(MIN_WIDTH, 1 << (n - 1).bit_length())
        tokens = np.zeros(width, np.int32)
        tokens[:n] = prompt
        positions = np.where(np.arange(width) < n, np.arange(width), -1).astype(np.int32)
        extra = ()
        if images:
            hidden = np.asarray(images[0][1]).shape[-1]
            features, index = np.zeros((width, hidden), np.float32), np.full(width, -1, np.int32)
            row = 0
            for start, feats in images:
                feats = np.asarray(feats, np.float32)
                features[row : row + len(feats)] = feats
                index[start : start + len(feats)] = np.arange(row, row + len(feats))
                row += len(feats)
            extra = (jnp.asarray(features), jnp.asarray(index))
        args = (self._params, jnp.asarray(tokens), jnp.asarray(positions), *extra)
        own, rank, top_id, top_lp = jax.device_get(self._fn(*args))
        out: list[PromptLogprob | None] = [None]
        for i in range(n - 1):
            entry = {int(prompt[i + 1]): (float(own[i]), int(rank[i]))}
            for j in range(num):
                entry.setdefault(int(top_id[i, j]), (float(top_lp[i, j]), j + 1))
            out.append(entry)
        return out
