"""Random EAGLE3 draft heads in the published format (`LlamaForCausalLMEagle3`: tensor names, config.json)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from support.common import model_call


def head_tensors(
    model,
    kv_heads=4,
    heads=4,
    head_dim=8,
    draft_vocab=None,
    aux=(1, 2, 4),
    seed=0,
    embed=False,
    fc_norm=False,
    inter=24,
):
    """A random EAGLE3 head for `model` with the published tensor names, and its config.json dict."""
    c = model.config
    h, vocab = c.hidden_size, c.vocab_size
    dv = vocab if draft_vocab is None else draft_vocab
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    t = {
        "fc.weight": w(h, len(aux) * h, scale=0.2),
        "norm.weight": 1 + w(h, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + w(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "lm_head.weight": w(dv, h, scale=1.0),
    }
    if dv != vocab:  # draft id i -> target id i + d2t[i]: a sorted subset of the target vocabulary
        ids = np.sort(rng.choice(vocab, dv, replace=False))
        t["d2t"] = (ids - np.arange(dv)).astype(np.int64)
        t["t2d"] = np.isin(np.arange(vocab), ids)
    if embed:
        t["embed_tokens.weight"] = w(vocab, h)
    if fc_norm:
        t["fc_norm.weight"] = 1 + w(len(aux) * h, scale=0.1)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True},
    }
    return t, config


def write_head(path, tensors, config):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def record_proposals(spec, on_propose=None) -> list:
    """Wraps `spec.propose` (an `Eagle3Speculation`) to record each non-empty proposal as ``(group, tokens,
    drafts)``: the request's group, its tokens so far (the last one sampled last) and the drafts. Returns the list
    it appends to; `on_propose(req)`, when given, runs on every call (empty proposals too)."""
    proposals, propose = [], spec.propose

    def record(req):
        drafts = propose(req)
        if on_propose is not None:
            on_propose(req)
        if drafts:
            proposals.append((req.group, req.token_slice(0, req.num_tokens), drafts))
        return drafts

    spec.propose = record
    return proposals


def target_aux(model, tokens, ids):
    """The target's aux states ``[n, len(ids) * H]`` over `tokens` (cache-free forward), padded to a power of two
    (positions -1: padding, which no real row attends to) and jitted: checking many proposals of growing
    sequences compiles a few programs instead of one per length (or, run eagerly, hundreds of one-op programs)."""
    n = len(tokens)
    width = 1 << max(4, (n - 1).bit_length())
    padded = np.zeros(width, np.int32)
    padded[:n] = tokens
    positions = np.where(np.arange(width) < n, np.arange(width), -1)
    aux = model_call(
        model, jnp.asarray(padded)[None], jnp.asarray(positions, jnp.int32)[None], aux_layer_ids=tuple(ids)
    )[2]
    return np.asarray(aux[0])[:n]
