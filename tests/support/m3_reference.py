"""transformers' MiniMax-M3 as the reference: tiny random models, their checkpoints, greedy runs.

Used by tests/test_m3_reference.py (live, needs torch + transformers) and by
tests/fixtures/make_m3_fixtures.py (writes the committed fixtures that
tests/test_m3_fixtures.py checks without torch).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv import SparseKVCache
from jax_sparse_kv.nn import MiniMaxM3Config


def reference_model(config: MiniMaxM3Config, seed: int = 0):
    """A transformers `MiniMaxM3VLForCausalLM` with random weights large enough to make choices sharp.

    transformers' own init (std 0.02, zero norms, zero bias) gives nearly flat
    logits and router scores; wider weights, non-zero norm weights and a
    non-zero ``e_score_correction_bias`` exercise every term of the model.
    """
    import torch
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    hf = MiniMaxM3VLTextConfig(**{**config.to_hf(), "bos_token_id": None, "eos_token_id": None})
    hf._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(hf).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            std = 0.3 if "norm" in name else 0.1 if "e_score" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def save_reference(model, path: str, *, original_names: bool = False, shards: int = 1) -> None:
    """Writes the reference model as a checkpoint directory (transformers' or the original key names)."""
    import torch
    from safetensors.torch import save_file

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn.weights import save_pretrained

    os.makedirs(path, exist_ok=True)
    if original_names or shards > 1:  # go through our writer, which knows the original spelling
        ours = MiniMaxM3.from_pretrained(_plain_checkpoint(model, path + ".tmp"))
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        save_pretrained(
            ours,
            path,
            spelling="original" if original_names else "transformers",
            max_shard_bytes=None if shards == 1 else total // shards + 1,
        )
        return
    with torch.no_grad():
        tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight")  # tied to the embedding, as transformers' save_pretrained does
        save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f)


def _plain_checkpoint(model, path: str) -> str:
    save_reference(model, path)
    return path


def reference_greedy(model, prompts: np.ndarray, steps: int):
    """Prefill ``prompts [batch, len]`` then ``steps`` greedy steps with transformers' own cache.

    Returns ``(prefill_logits [b, len, vocab], step_logits [steps, b, vocab],
    tokens [b, steps + 1], selections)`` where ``selections[layer]`` is a list
    (prefill, then each step) of ``[b, index_heads, q_len, topk]`` block ids.
    """
    import torch

    selections: dict[int, list[np.ndarray]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        indexer = layer.self_attn.indexer
        if indexer is not None:
            hooks.append(
                indexer.register_forward_hook(
                    lambda mod, args, out, i=i: selections.setdefault(i, []).append(out.numpy().copy())
                )
            )
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(prompts), use_cache=True)
            prefill = out.logits.numpy().copy()
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            token = out.logits[:, -1].argmax(-1)
            tokens, step_logits = [token.numpy().copy()], []
            for _ in range(steps):
                out = model(token[:, None], cache=cache, use_cache=True)
                cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
                step_logits.append(out.logits[:, -1].numpy().copy())
                token = out.logits[:, -1].argmax(-1)
                tokens.append(token.numpy().copy())
    finally:
        for h in hooks:
            h.remove()
    return prefill, np.stack(step_logits), np.stack(tokens, axis=1), selections


# ------------------------------------------------------------- this project's side


def shuffled_table(batch: int, pages: int, seed: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).permutation(batch * pages) + 1  # page 0 is the padding page
    return ids.reshape(batch, pages).astype(np.int32)


def run_ours(model, prompts, steps, page_size, dtype="float32", kv_scale=1.0):
    """Prefill + greedy steps through the cache: (prefill logits, step logits, tokens, selections)."""
    config = model.config
    batch, length = prompts.shape
    pages = -(-(length + steps) // page_size)
    layout = config.layout(num_slots=batch * pages * page_size, page_size=page_size, dtype=dtype)
    cache = SparseKVCache.zeros(layout)
    table = jnp.asarray(shuffled_table(batch, pages))
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=3)
    def step(params, tokens, positions, cache):
        with jax.default_matmul_precision("highest"):
            return nnx.merge(graphdef, params)(
                tokens, positions, cache, table, kv_scale=kv_scale, return_selection=True
            )

    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    prefill, cache, sel = step(params, jnp.asarray(prompts), positions, cache)
    selections = {i: [np.asarray(s)] for i, s in sel.items()}
    token = jnp.argmax(prefill[:, -1], axis=-1)
    tokens, step_logits = [np.asarray(token)], []
    for i in range(steps):
        logits, cache, sel = step(params, token[:, None], jnp.full((batch, 1), length + i), cache)
        for layer, s in sel.items():
            selections[layer].append(np.asarray(s))
        step_logits.append(np.asarray(logits[:, 0]))
        token = jnp.argmax(logits[:, 0], axis=-1)
        tokens.append(np.asarray(token))
    step_logits = np.stack(step_logits) if step_logits else np.zeros((batch, 0, config.vocab_size))
    return np.asarray(prefill), step_logits, np.stack(tokens, axis=1), selections


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def same_block_sets(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """ours ``[b, q, heads, topk]`` vs transformers' ``[b, heads, q, topk]``: equal as sets per (b, head, q)."""
    theirs = np.swapaxes(theirs, 1, 2)
    assert ours.shape[:3] == theirs.shape[:3], (ours.shape, theirs.shape)
    for idx in np.ndindex(*ours.shape[:3]):
        a, b = set(ours[idx].tolist()) - {-1}, set(theirs[idx].tolist()) - {-1}
        if a != b:
            return False
    return True
