"""The one parser of MiniMax-M3 `config.json` files, in every spelling they come in.

Three spellings describe the same model:

- transformers' flat ``MiniMaxM3VLTextConfig.to_dict()``: ``layer_types``
  (``"full_attention"`` / ``"minimax_m3_sparse"``), ``index_n_heads``,
  ``index_head_dim``, ``index_block_size``, ``index_topk_blocks``,
  ``index_local_blocks``, ``mlp_layer_types`` (``"dense"`` / ``"sparse"``),
  ``rope_parameters``, ``rotary_dim``;
- the VL wrapper: the above under ``text_config``;
- the original checkpoint's: ``sparse_attention_config`` with
  ``sparse_attention_freq``, ``sparse_disable_index_value``,
  ``sparse_index_dim``, ``sparse_num_index_heads``, ``sparse_block_size``,
  ``sparse_topk_blocks``, ``sparse_local_block``; ``moe_layer_freq``;
  ``n_shared_experts``; ``rope_theta``.

`parse_m3_config` turns any of them into one plain dict of canonical fields
(transformers' names). `SparseKVLayout.from_hf_config` and
`jax_sparse_kv.nn.MiniMaxM3Config` both read it, so a layout and a model can
never disagree about which layers are sparse. Anything ambiguous raises
`LayoutError` naming the field: a silently wrong (e.g. all-dense) layout is the
worst failure a cache can have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax_sparse_kv.errors import LayoutError

__all__ = ["M3_DEFAULTS", "INDEX_FIELD_SPELLINGS", "parse_m3_config", "eos_ids", "DENSE", "SPARSE"]

DENSE = "full_attention"
SPARSE = "minimax_m3_sparse"

#: transformers' defaults of `MiniMaxM3VLTextConfig` (the full-size model); a
#: config.json that omits a field means this value, as it does for transformers.
M3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 200064,
    "hidden_size": 6144,
    "intermediate_size": 3072,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 4,
    "num_local_experts": 128,
    "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072,
    "routed_scaling_factor": 2.0,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rope_theta": 5_000_000.0,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
    "max_position_embeddings": 524288,
}

# flat (transformers) name -> sparse_attention_config (checkpoint) name
INDEX_FIELD_SPELLINGS = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}


def _per_layer(field: str, value: Any, num_layers: int) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise LayoutError(f"{field} must be a list with one entry per layer, got {value!r}")
    value = list(value)
    if len(value) != num_layers:
        raise LayoutError(f"{field} has {len(value)} entries but num_hidden_layers={num_layers}")
    return value


def _attention_types(config: Mapping[str, Any], sparse_cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``"full_attention"`` / ``"minimax_m3_sparse"`` per layer, from whichever spelling is there."""
    if sparse_cfg.get("use_sparse_attention") is False:  # said explicitly: every layer dense
        return [DENSE] * num_layers
    from_types = from_freq = None
    if config.get("layer_types") is not None:
        from_types = _per_layer("layer_types", config["layer_types"], num_layers)
        unknown = sorted({t for t in from_types if t not in (DENSE, SPARSE)})
        if unknown:
            raise LayoutError(f"layer_types has unknown attention types {unknown}; expected {DENSE!r} or {SPARSE!r}")
    if sparse_cfg.get("sparse_attention_freq") is not None:
        freq = sparse_cfg["sparse_attention_freq"]
        if isinstance(freq, (int, float)) and not isinstance(freq, bool):
            freq = [freq] * num_layers
        freq = _per_layer("sparse_attention_config.sparse_attention_freq", freq, num_layers)
        from_freq = [SPARSE if f else DENSE for f in freq]
    if from_types is not None and from_freq is not None and from_types != from_freq:
        raise LayoutError("layer_types and sparse_attention_config.sparse_attention_freq disagree")
    if from_types is not None:
        return from_types
    if from_freq is not None:
        return from_freq
    raise LayoutError(
        "config names no attention type per layer: expected 'layer_types' (transformers) or "
        "'sparse_attention_config.sparse_attention_freq' (checkpoint); refusing to guess an all-dense layout"
    )


def _rotary_dim(config: Mapping[str, Any], head_dim: int) -> tuple[float, int]:
    """``(rope_theta, rotary_dim)``.

    transformers rotates ``head_dim * partial_rotary_factor`` channels and
    ignores ``rotary_dim``; SGLang reads ``rotary_dim``. The factor wins when
    present; both present and disagreeing is an error, not a guess.
    """
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise LayoutError(f"rope_parameters must be a dict, got {type(rope).__name__}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise LayoutError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", config.get("rope_theta", M3_DEFAULTS["rope_theta"]))
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    rotary_dim = config.get("rotary_dim")
    if factor is not None:
        from_factor = int(head_dim * float(factor))
        if rotary_dim is not None and int(rotary_dim) != from_factor:
            raise LayoutError(
                f"rotary_dim={rotary_dim} disagrees with head_dim * partial_rotary_factor = "
                f"{head_dim} * {factor} = {from_factor}"
            )
        rotary_dim = from_factor
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise LayoutError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
    return float(theta), rotary_dim


def parse_m3_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical fields of a MiniMax-M3 (text) config in any spelling.

    Returns a dict with transformers' field names plus three resolved ones:
    ``layer_types`` and ``mlp_layer_types`` (tuples, one entry per layer),
    ``disable_index_value`` (tuple of bools: True = the indexer keeps no V),
    ``rope_theta`` and ``rotary_dim`` (the channels actually rotated).

    Raises:
      LayoutError: naming the field, for a missing layer count or attention
        types, per-layer lists of the wrong length, unknown types, spellings
        that disagree, or an unsupported RoPE.
    """
    if not isinstance(config, Mapping):
        raise LayoutError(f"config must be a dict, got {type(config).__name__}")
    if isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    if "num_hidden_layers" not in config:
        raise LayoutError("config is missing 'num_hidden_layers'")
    num_layers = config["num_hidden_layers"]
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise LayoutError(f"num_hidden_layers must be a positive int, got {num_layers!r}")
    sparse_cfg = config.get("sparse_attention_config") or {}
    if not isinstance(sparse_cfg, Mapping):
        raise LayoutError(f"sparse_attention_config must be a dict, got {type(sparse_cfg).__name__}")

    out: dict[str, Any] = {"num_hidden_layers": num_layers}
    for name, default in M3_DEFAULTS.items():
        out[name] = config.get(name, default)
    if "num_experts" in config and "num_local_experts" not in config:
        out["num_local_experts"] = config["num_experts"]
    if "shared_intermediate_size" not in config and config.get("n_shared_experts") is not None:
        out["shared_intermediate_size"] = int(out["intermediate_size"]) * int(config["n_shared_experts"])
    for flat, legacy in INDEX_FIELD_SPELLINGS.items():
        if legacy in sparse_cfg:
            if flat in config and config[flat] != sparse_cfg[legacy]:
                raise LayoutError(
                    f"{flat}={config[flat]} disagrees with sparse_attention_config.{legacy}={sparse_cfg[legacy]}"
                )
            out[flat] = sparse_cfg[legacy]
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = int(out["hidden_size"]) // int(out["num_attention_heads"])
    out["head_dim"] = int(head_dim)

    layer_types = _attention_types(config, sparse_cfg, num_layers)
    out["layer_types"] = tuple(layer_types)
    no_value = sparse_cfg.get("sparse_disable_index_value", 1)  # transformers' M3 has no index V at all
    if isinstance(no_value, (int, float)):
        no_value = [no_value] * num_layers
    no_value = _per_layer("sparse_attention_config.sparse_disable_index_value", no_value, num_layers)
    out["disable_index_value"] = tuple(bool(f) or t == DENSE for f, t in zip(no_value, layer_types, strict=True))

    if config.get("mlp_layer_types") is not None:
        mlp = _per_layer("mlp_layer_types", config["mlp_layer_types"], num_layers)
        unknown = sorted({t for t in mlp if t not in ("dense", "sparse")})
        if unknown:
            raise LayoutError(f"mlp_layer_types has unknown types {unknown}; expected 'dense' or 'sparse'")
        if config.get("moe_layer_freq") is not None:
            freq = _per_layer("moe_layer_freq", config["moe_layer_freq"], num_layers)
            if mlp != ["sparse" if f else "dense" for f in freq]:
                raise LayoutError("mlp_layer_types and moe_layer_freq disagree")
    elif config.get("moe_layer_freq") is not None:
        mlp = ["sparse" if f else "dense" for f in _per_layer("moe_layer_freq", config["moe_layer_freq"], num_layers)]
    else:
        mlp = ["sparse"] * num_layers  # transformers' default: every layer MoE
    out["mlp_layer_types"] = tuple(mlp)
    out["rope_theta"], out["rotary_dim"] = _rotary_dim(config, out["head_dim"])
    out["eos_token_id"] = eos_ids(config.get("eos_token_id"))
    return out


def eos_ids(value: Any, source: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` (an int, a list of ints or None) as a tuple of ints; `LayoutError` naming `source`."""
    if value is None:
        return ()
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise LayoutError(f"{source}: eos_token_id must be an int, a list of ints or null, got {value!r}")
    return tuple(values)
