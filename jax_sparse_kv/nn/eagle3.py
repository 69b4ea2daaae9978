"""EAGLE3 draft heads (`LlamaForCausalLMEagle3`, as published) for a `MiniMaxM3` target.

The head is one Llama decoder layer. For a row at position ``p`` it takes

- ``hidden``: at the first draft step after a verification, ``fc([aux_k1(p); aux_k2(p); ...])``, where
  ``aux_k(p)`` is the target's residual stream entering layer ``k`` at position ``p`` (the layer ids of
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, concatenated in ascending order; EAGLE 3.1 heads first
  RMS-normalise each ``hidden``-wide chunk with its own ``fc_norm``); at later draft steps, the draft's own
  hidden state of the row before (pre-final-norm; EAGLE 3.1 ``norm_output``: post-norm);
- ``token``: the token at position ``p + 1`` (the first draft step pairs the target's hidden state of ``p``
  with the next token), whose embedding is ``embed_tokens`` (the target's where the head has none).

``x = [input_layernorm(embed(token)); hidden_norm(hidden)]`` (width ``2 * hidden``) gives q, k, v (RoPE at
``p``, causal attention over the draft's own K/V of the sequence), ``r = o_proj(attn) + hidden``,
``pre = mlp(post_attention_layernorm(r)) + r``, logits ``lm_head(norm(pre))`` over the draft vocabulary; draft
id ``i`` is target id ``i + d2t[i]``. The row predicts the token at ``p + 2``.

Sources (read for the facts, not copied): vLLM ``vllm/model_executor/models/llama_eagle3.py`` (commit
00bd1493b3e82d6c13c68ee8a0e1c5a96707e190) and ``vllm/v1/spec_decode/eagle.py``; see BUILD.md, "EAGLE3".
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv import ops

__all__ = ["Eagle3Config", "Eagle3Draft"]

_LAYER = "midlayer."
_REQUIRED = (
    "fc.weight",
    "norm.weight",
    _LAYER + "input_layernorm.weight",
    _LAYER + "hidden_norm.weight",
    _LAYER + "post_attention_layernorm.weight",
    _LAYER + "self_attn.q_proj.weight",
    _LAYER + "self_attn.k_proj.weight",
    _LAYER + "self_attn.v_proj.weight",
    _LAYER + "self_attn.o_proj.weight",
    _LAYER + "mlp.gate_proj.weight",
    _LAYER + "mlp.up_proj.weight",
    _LAYER + "mlp.down_proj.weight",
)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The fields of an EAGLE3 head's config.json this implementation reads."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_output: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], target_layers: int) -> Eagle3Config:
        """From config.json; `target_layers`: the target's ``num_hidden_layers`` (vLLM's default aux layers
        ``(2, L // 2, L - 3)`` when the head names none). Raises `ValueError` naming a missing or bad key."""
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(raw.get(key), int) or raw[key] < 1:
                raise ValueError(f"EAGLE3 config.json: {key} must be an int >= 1, got {raw.get(key)!r}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE3 config.json: num_hidden_layers={raw['num_hidden_layers']} (one layer supported)")
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            ids = (2, target_layers // 2, target_layers - 3)
        ids = tuple(sorted(int(i) for i in ids))
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"EAGLE3 config.json: rope_scaling of type {kind!r} is not supported (default only)")
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            aux_layer_ids=ids,
            norm_output=bool(raw.get("norm_output", eagle.get("norm_output", False))),
        )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm over the last axis (f32 inside): ``x / rms(x) * weight``."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return out * weight.astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Llama's rotate-half RoPE over the full head: ``x [N, heads, D]`` at ``positions [N]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.maximum(positions, 0).astype(jnp.float32)[:, None] * inv[None]  # [N, D/2]
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Eagle3Draft:
    """An EAGLE3 head for a target model: its weights (``params``, a dict of device arrays) and config.

    ``params`` keys: ``fc [n_aux * H, H]``, optional ``fc_norm [n_aux, H]``, ``input_norm``, ``hidden_norm``,
    ``post_norm``, ``norm [H]``, ``q [2H, heads * D]``, ``k``, ``v [2H, kv_heads * D]``, ``o [heads * D, H]``,
    ``gate``, ``up [H, I]``, ``down [I, H]``, ``lm_head [H, Vd]``, ``embed [V, H]`` (the target's when the
    head has none), ``d2t [Vd]`` int32 (target id of draft id ``i`` is ``i + d2t[i]``).
    """

    def __init__(self, config: Eagle3Config, params: dict[str, jax.Array]):
        self.config = config
        self.params = params
        self._propose: Any = None  # `propose`'s jitted `draft`, made when first called

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose input residual streams the head reads, ascending."""
        return self.config.aux_layer_ids

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: Any, dtype: Any = None, mesh: Any = None) -> Eagle3Draft:
        """Loads a published EAGLE3 head (config.json + ``*.safetensors``) for `target` (a `MiniMaxM3`).

        The weights take the target's dtype (or `dtype`) and are replicated on `mesh` (default: the mesh of
        the target's embedding, if it has one). Raises `ValueError` naming the key when the head's hidden
        size or vocabulary is not the target's, an aux layer id lies outside ``0..num_hidden_layers``, or a
        tensor is missing or of the wrong shape.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        tc = target.config
        config = Eagle3Config.from_dict(raw, tc.num_hidden_layers)
        if config.hidden_size != tc.hidden_size:
            raise ValueError(f"EAGLE3 hidden_size={config.hidden_size} is not the target's {tc.hidden_size}")
        if config.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE3 vocab_size={config.vocab_size} is not the target's {tc.vocab_size}")
        bad = [i for i in config.aux_layer_ids if not 0 <= i <= tc.num_hidden_layers]
        if bad:
            raise ValueError(
                f"EAGLE3 eagle_aux_hidden_state_layer_ids {bad} outside the target's layers 0..{tc.num_hidden_layers}"
            )
        tensors: dict[str, np.ndarray] = {}
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"EAGLE3 head {path}: no *.safetensors file")
        for file in files:
            with safe_open(os.path.join(path, file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors[key.removeprefix("model.")] = f.get_tensor(key)
        return cls.from_tensors(config, tensors, target, dtype=dtype, mesh=mesh)

    @classmethod
    def from_tensors(
        cls, config: Eagle3Config, tensors: dict[str, np.ndarray], target: Any, dtype: Any = None, mesh: Any = None
    ) -> Eagle3Draft:
        """From the published tensor names (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
        ``d2t``, optional ``embed_tokens.weight``, ``fc_norm*``); see `from_pretrained`."""
        c, h = config, config.hidden_size
        n_aux = len(c.aux_layer_ids)
        hq, hkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = {
            "fc.weight": (h, n_aux * h),
            "norm.weight": (h,),
            _LAYER + "input_layernorm.weight": (h,),
            _LAYER + "hidden_norm.weight": (h,),
            _LAYER + "post_attention_layernorm.weight": (h,),
            _LAYER + "self_attn.q_proj.weight": (hq, 2 * h),
            _LAYER + "self_attn.k_proj.weight": (hkv, 2 * h),
            _LAYER + "self_attn.v_proj.weight": (hkv, 2 * h),
            _LAYER + "self_attn.o_proj.weight": (h, hq),
            _LAYER + "mlp.gate_proj.weight": (c.intermediate_size, h),
            _LAYER + "mlp.up_proj.weight": (c.intermediate_size, h),
            _LAYER + "mlp.down_proj.weight": (h, c.intermediate_size),
            "lm_head.weight": (c.draft_vocab_size, h),
            "embed_tokens.weight": (c.vocab_size, h),
            "d2t": (c.draft_vocab_size,),
        }
        for key in _REQUIRED:
            if key not in tensors:
                raise ValueError(f"EAGLE3 head: missing tensor {key!r}")
        if c.num_attention_heads % c.num_key_value_heads:
            raise ValueError(
                f"EAGLE3 num_key_value_heads={c.num_key_value_heads} does not divide "
                f"num_attention_heads={c.num_attention_heads}"
            )
        for key, shape in shapes.items():
            if key in tensors and tuple(tensors[key].shape) != shape:
                raise ValueError(f"EAGLE3 head: tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {shape}")
        if c.draft_vocab_size != c.vocab_size and "d2t" not in tensors:
            raise ValueError(
                f"EAGLE3 head: missing tensor 'd2t' (draft_vocab_size={c.draft_vocab_size} < vocab_size={c.vocab_size})"
            )
        dtype = target.dtype if dtype is None else jnp.dtype(dtype)
        t = {k: np.asarray(v) for k, v in tensors.items()}
        params: dict[str, Any] = {
            "fc": t["fc.weight"].T,
            "norm": t["norm.weight"],
            "input_norm": t[_LAYER + "input_layernorm.weight"],
            "hidden_norm": t[_LAYER + "hidden_norm.weight"],
            "post_norm": t[_LAYER + "post_attention_layernorm.weight"],
            "q": t[_LAYER + "self_attn.q_proj.weight"].T,
            "k": t[_LAYER + "self_attn.k_proj.weight"].T,
            "v": t[_LAYER + "self_attn.v_proj.weight"].T,
            "o": t[_LAYER + "self_attn.o_proj.weight"].T,
            "gate": t[_LAYER + "mlp.gate_proj.weight"].T,
            "up": t[_LAYER + "mlp.up_proj.weight"].T,
            "down": t[_LAYER + "mlp.down_proj.weight"].T,
        }
        fc_norm = _fc_norm(t, n_aux, h)
        if fc_norm is not None:
            params["fc_norm"] = fc_norm
        if "lm_head.weight" in t:
            params["lm_head"] = t["lm_head.weight"].T
        else:  # the target's LM head (same vocabulary)
            if c.draft_vocab_size != c.vocab_size:
                raise ValueError("EAGLE3 head: missing tensor 'lm_head.weight' (draft vocabulary differs from target)")
            w = target.embed_tokens.weight[...] if target.config.tie_word_embeddings else target.lm_head.weight[...]
            params["lm_head"] = np.asarray(w).T if target.config.tie_word_embeddings else np.asarray(w)
        d2t = t.get("d2t", np.zeros(c.draft_vocab_size, np.int64)).astype(np.int64)
        ids = np.arange(c.draft_vocab_size) + d2t
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"EAGLE3 head: tensor 'd2t' maps draft ids outside the target vocabulary {c.vocab_size}")
        if mesh is None:
            sharding = getattr(target.embed_tokens.weight[...], "sharding", None)
            mesh = getattr(sharding, "mesh", None)
        put = (
            (lambda x: jnp.asarray(x))
            if mesh is None
            else partial(jax.device_put, device=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        )
        out = {k: put(np.asarray(v).astype(dtype)) for k, v in params.items()}
        out["d2t"] = put(d2t.astype(np.int32))
        out["embed"] = (
            put(t["embed_tokens.weight"].astype(dtype))
            if "embed_tokens.weight" in t
            else target.embed_tokens.weight[...]
        )
        return cls(config, out)

    # ------------------------------------------------------------------ compute (pure functions of params)

    def combine(self, params: dict[str, jax.Array], aux: jax.Array) -> jax.Array:
        """``fc`` over the target's aux states ``[N, n_aux * H]`` (each chunk RMS-normalised first when the
        head has ``fc_norm``) -> ``[N, H]``."""
        if "fc_norm" in params:
            n, h = params["fc_norm"].shape
            chunks = aux.reshape(aux.shape[:-1] + (n, h))
            aux = rms_norm(chunks, params["fc_norm"], self.config.rms_norm_eps).reshape(aux.shape)
        return jnp.dot(aux.astype(params["fc"].dtype), params["fc"], preferred_element_type=jnp.float32)

    def layer(
        self,
        params: dict[str, jax.Array],
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        k_pool: jax.Array,
        v_pool: jax.Array,
        slots: jax.Array,
        tables: jax.Array,
        page_size: int,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """One draft row per token: ``tokens [N]``, ``hidden [N, H]``, ``positions [N]`` (``-1``: padding),
        each row's K/V written at ``slots [N]`` (``>= pool rows``: none) of the pools ``[rows, kv_heads, D]``,
        then attending over its sequence's pages ``tables [N, W]`` up to its position.

        Returns ``(draft logits [N, Vd] f32, next hidden [N, H] (pre-norm, or post-norm with norm_output),
        target ids of the argmax [N], k_pool, v_pool)``."""
        c, p = self.config, params
        eps, dt = c.rms_norm_eps, p["q"].dtype
        emb = jnp.take(p["embed"], tokens, axis=0)
        x = jnp.concatenate([rms_norm(emb, p["input_norm"], eps), rms_norm(hidden, p["hidden_norm"], eps)], -1)
        x = x.astype(dt)
        n = tokens.shape[0]

        def proj(w, heads):
            return jnp.dot(x, w, preferred_element_type=jnp.float32).reshape(n, heads, c.head_dim)

        q = rope(proj(p["q"], c.num_attention_heads), positions, c.rope_theta)
        k = rope(proj(p["k"], c.num_key_value_heads), positions, c.rope_theta)
        v = proj(p["v"], c.num_key_value_heads)
        k_pool = k_pool.at[slots].set(k.astype(k_pool.dtype), mode="drop")
        v_pool = v_pool.at[slots].set(v.astype(v_pool.dtype), mode="drop")
        attn = ops.dense_attention(
            q[:, None],
            ops.PagedKV(k_pool, tables, page_size),
            ops.PagedKV(v_pool, tables, page_size),
            positions[:, None],
        )
        o = jnp.dot(attn.reshape(n, -1).astype(dt), p["o"], preferred_element_type=jnp.float32)
        r = o + hidden.astype(jnp.float32)
        m = rms_norm(r, p["post_norm"], eps).astype(dt)
        g = jnp.dot(m, p["gate"], preferred_element_type=jnp.float32)
        u = jnp.dot(m, p["up"], preferred_element_type=jnp.float32)
        pre = jnp.dot((jax.nn.silu(g) * u).astype(dt), p["down"], preferred_element_type=jnp.float32) + r
        normed = rms_norm(pre, p["norm"], eps)
        logits = jnp.dot(normed.astype(dt), p["lm_head"], preferred_element_type=jnp.float32)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        ids = best + p["d2t"][best]
        return logits, (normed if c.norm_output else pre), ids, k_pool, v_pool

    def draft(
        self,
        params: dict[str, jax.Array],
        k_pool: jax.Array,
        v_pool: jax.Array,
        aux: jax.Array,
        rows: jax.Array,
        tokens: jax.Array,
        positions: jax.Array,
        slots: jax.Array,
        tables: jax.Array,
        last: jax.Array,
        seq_tables: jax.Array,
        next_pos: jax.Array,
        counts: jax.Array,
        page_size: int,
        num_steps: int,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Catch-up rows with the target's hidden states, then greedy drafting, in one program.

        ``aux [T, n_aux * H]`` (a target step's), ``rows [N]`` the aux row of each catch-up row (token
        ``tokens [N]`` = the token after its position ``positions [N]``, K/V to ``slots [N]``, pages
        ``tables [N, W]``); ``last [S]`` each sequence's catch-up row that gives its first draft; then
        ``num_steps - 1`` rows per sequence at ``next_pos [S] + j`` (pages ``seq_tables [S, W]``) feed each
        draft back with the draft's own hidden state. ``counts [S]``: drafts wanted (0: padding).
        Returns ``(drafts [num_steps, S] target ids (-1 past a count), k_pool, v_pool)``."""
        hidden = self.combine(params, aux[rows])
        _, hid, ids, k_pool, v_pool = self.layer(
            params, tokens, hidden, positions, k_pool, v_pool, slots, tables, page_size
        )
        first, hid = ids[last], hid[last]
        page_of = jnp.arange(seq_tables.shape[0])
        drop = k_pool.shape[0]

        def step(carry, j):
            tok, hid, kp, vp = carry
            active = j < counts
            pos = jnp.where(active, next_pos + j - 1, -1)
            page = seq_tables[page_of, jnp.maximum(pos, 0) // page_size]
            slot = jnp.where(active, page * page_size + jnp.maximum(pos, 0) % page_size, drop)
            _, new_hid, new_ids, kp, vp = self.layer(params, tok, hid, pos, kp, vp, slot, seq_tables, page_size)
            return (jnp.where(active, new_ids, tok), new_hid, kp, vp), jnp.where(active, new_ids, -1)

        (_, _, k_pool, v_pool), rest = jax.lax.scan(
            step, (first, hid, k_pool, v_pool), jnp.arange(1, num_steps, dtype=jnp.int32)
        )
        return jnp.concatenate([jnp.where(counts >= 1, first, -1)[None], rest]), k_pool, v_pool

    def propose(self, aux: Any, tokens: Any, num_steps: int) -> list[int]:
        """Drafts for one sequence from scratch (a reference; the engine uses `draft` on its pools): ``aux
        [n, n_aux * H]`` the target's aux states at positions ``0..n-1``, ``tokens [n + 1]`` the sequence
        (its last token is the one the target sampled last). Returns `num_steps` target token ids."""
        aux, tokens = np.asarray(aux), np.asarray(tokens, np.int32)
        n, page = aux.shape[0], 8
        size = 1 << max(3, (n - 1).bit_length())  # rows padded to a power of two (one program per bucket)
        pages = -(-(size + num_steps) // page)
        c = self.config
        pool = jnp.zeros((pages * page, c.num_key_value_heads, c.head_dim), jnp.float32)
        table = np.arange(pages, dtype=np.int32)[None]
        padded = np.zeros((size, aux.shape[1]), aux.dtype)
        padded[:n] = aux
        toks, pos = np.zeros(size, np.int32), np.full(size, -1, np.int32)
        toks[:n], pos[:n] = tokens[1 : n + 1], np.arange(n)
        slots = np.where(pos >= 0, pos, pages * page).astype(np.int32)
        if self._propose is None:
            self._propose = jax.jit(self.draft, static_argnames=("page_size", "num_steps"))
        out, _, _ = self._propose(
            self.params,
            pool,
            pool,
            padded,
            np.arange(size),
            toks,
            pos,
            slots,
            np.repeat(table, size, 0),
            np.asarray([n - 1]),
            table,
            np.asarray([n]),
            np.asarray([num_steps]),
            page_size=page,
            num_steps=num_steps,
        )
        return [int(t) for t in np.asarray(out)[:, 0]]


def _fc_norm(t: dict[str, np.ndarray], n_aux: int, h: int) -> np.ndarray | None:
    """EAGLE 3.1's per-chunk norm of the aux states: ``fc_norm.weight [n_aux * H]`` or ``fc_norm.{i}.weight
    [H]`` -> ``[n_aux, H]``; None when the head has none."""
    if "fc_norm.weight" in t:
        w = t["fc_norm.weight"]
        if w.size != n_aux * h:
            raise ValueError(f"EAGLE3 head: tensor 'fc_norm.weight' has shape {w.shape}, expected ({n_aux * h},)")
        return w.reshape(n_aux, h)
    keys = [f"fc_norm.{i}.weight" for i in range(n_aux)]
    present = [k for k in keys if k in t]
    if not present:
        return None
    missing = [k for k in keys if k not in t]
    if missing:
        raise ValueError(f"EAGLE3 head: missing tensor {missing[0]!r}")
    return np.stack([t[k].reshape(h) for k in keys])
