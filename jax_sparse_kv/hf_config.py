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
(transformers' names). RoPE is plain (``rope_type="default"``) or YaRN
(``"yarn"``, in ``rope_parameters`` or the legacy ``rope_scaling``);
`apply_hf_overrides` merges vLLM-style ``--hf-overrides`` into a config first. `SparseKVLayout.from_hf_config` and
`jax_sparse_kv.nn.MiniMaxM3Config` both read it, so a layout and a model can
never disagree about which layers are sparse. Anything ambiguous raises
`LayoutError` naming the field: a silently wrong (e.g. all-dense) layout is the
worst failure a cache can have.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jax_sparse_kv.errors import LayoutError

__all__ = [
    "M3_DEFAULTS",
    "INDEX_FIELD_SPELLINGS",
    "ROPE_TYPES",
    "YARN_FIELDS",
    "parse_m3_config",
    "apply_hf_overrides",
    "context_length",
    "eos_ids",
    "DENSE",
    "SPARSE",
]

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


#: the keys a ``"yarn"`` rope dict may hold (transformers' `_validate_yarn_rope_parameters` plus the
#: two every rope dict carries and the legacy ``type``)
YARN_FIELDS = (
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)
ROPE_TYPES = ("default", "yarn")


def _rope_dict(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(field name, rope dict)``: ``rope_parameters`` with ``rope_scaling``'s keys over it.

    ``rope_scaling`` is the legacy name, and the one vLLM's ``--hf-overrides`` examples set; vLLM merges it into
    the config's rope parameters, so a yarn ``rope_scaling`` over a default ``rope_parameters`` keeps that
    dict's ``rope_theta`` and ``partial_rotary_factor``.
    """
    merged: dict[str, Any] = {}
    names = []
    for name in ("rope_parameters", "rope_scaling"):
        part = config.get(name)
        if part is None:
            continue
        if not isinstance(part, Mapping):
            raise LayoutError(f"{name} must be a dict, got {type(part).__name__}")
        part = dict(part)
        if "type" in part:  # the legacy spelling of rope_type
            kind = part.pop("type")
            if part.setdefault("rope_type", kind) != kind:
                raise LayoutError(f"{name}.type={kind!r} disagrees with {name}.rope_type={part['rope_type']!r}")
        merged.update(part)
        names.append(name)
    return ("rope_scaling" if names == ["rope_scaling"] else "rope_parameters"), merged


def _number(field: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise LayoutError(f"{field} must be a number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise LayoutError(f"{field} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def _yarn(config: Mapping[str, Any], field: str, rope: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved YaRN parameters of a ``"yarn"`` rope dict (defaults and fallbacks as transformers')."""
    unknown = sorted(k for k in rope if k not in YARN_FIELDS)
    if unknown:
        raise LayoutError(f"{field} has keys YaRN does not know: {unknown}; expected some of {list(YARN_FIELDS[2:])}")
    max_positions = config.get("max_position_embeddings", M3_DEFAULTS["max_position_embeddings"])
    # transformers: a top-level original_max_position_embeddings wins (Phi-3 keeps it there), then the rope
    # dict's, then max_position_embeddings
    if config.get("original_max_position_embeddings") is not None:
        original, original_field = config["original_max_position_embeddings"], "original_max_position_embeddings"
    else:
        original = rope.get("original_max_position_embeddings", max_positions)
        original_field = f"{field}.original_max_position_embeddings"
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise LayoutError(f"{original_field} must be a positive int, got {original!r}")
    if "factor" not in rope:
        raise LayoutError(f"{field}.factor is missing: YaRN needs the context's scaling factor")
    factor = rope["factor"]
    if factor is None:  # transformers: the ratio of the two context lengths
        factor = _number("max_position_embeddings", max_positions, minimum=0, strict=True) / original
        factor_field = f"max_position_embeddings / {field}.original_max_position_embeddings"
    else:
        factor_field = f"{field}.factor"
    factor = _number(factor_field, factor, minimum=1.0)
    out: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    # transformers reads `beta_fast or 32`, `beta_slow or 1`: 0 and None both mean the default
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        value = rope.get(name)
        out[name] = _number(f"{field}.{name}", value) if value else default
    if out["beta_fast"] < out["beta_slow"]:
        raise LayoutError(f"{field}.beta_fast={out['beta_fast']:g} must be >= {field}.beta_slow={out['beta_slow']:g}")
    for name in ("mscale", "mscale_all_dim"):
        value = rope.get(name)
        out[name] = None if value is None else _number(f"{field}.{name}", value)
    value = rope.get("attention_factor")
    out["attention_factor"] = (
        None if value is None else _number(f"{field}.attention_factor", value, minimum=0, strict=True)
    )
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise LayoutError(f"{field}.truncate must be true or false, got {truncate!r}")
    out["truncate"] = truncate
    return out


def _rope(config: Mapping[str, Any], head_dim: int) -> tuple[float, int, dict[str, Any] | None]:
    """``(rope_theta, rotary_dim, rope_scaling)``; ``rope_scaling`` is None or `_yarn`'s resolved dict.

    transformers rotates ``head_dim * partial_rotary_factor`` channels and
    ignores ``rotary_dim``; SGLang reads ``rotary_dim``. The factor wins when
    present; both present and disagreeing is an error, not a guess.
    """
    field, rope = _rope_dict(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise LayoutError(f"{field}.rope_type={rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", config.get("rope_theta", M3_DEFAULTS["rope_theta"]))
    theta = _number(f"{field}.rope_theta" if "rope_theta" in rope else "rope_theta", theta, minimum=1.0, strict=True)
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
    scaling = _yarn(config, field, rope) if rope_type == "yarn" else None
    return theta, rotary_dim, scaling


def context_length(parsed: Mapping[str, Any]) -> int:
    """Positions a parsed config serves: ``original_max_position_embeddings * factor`` under YaRN.

    That is the length vLLM derives for its ``max_model_len`` from a yarn ``rope_scaling`` (so
    ``{"factor": 2.0, "original_max_position_embeddings": 524288}`` serves 1048576 positions); without
    scaling, ``max_position_embeddings``. `parsed` is `parse_m3_config`'s dict or a `MiniMaxM3Config`-like
    mapping with ``rope_scaling`` and ``max_position_embeddings``.
    """
    scaling = parsed.get("rope_scaling")
    if scaling is None:
        return int(parsed["max_position_embeddings"])
    return int(scaling["original_max_position_embeddings"] * scaling["factor"])


def apply_hf_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """`config` with `overrides` merged in, as vLLM's ``--hf-overrides`` merges them into config.json.

    A dict in `overrides` merges key by key into the dict it lands on (recursively, so
    ``{"text_config": {"rope_scaling": {...}}}`` changes one field of a VL wrapper's text config and
    keeps the rest); any other value, or a dict landing on a non-dict, replaces. On a flat (text-only)
    config, a ``text_config`` override merges into the top level. `overrides` may be the JSON text of
    the flag. Neither argument is modified; the result shares no dict with them.

    Raises:
      LayoutError: `config` or `overrides` is not a dict (JSON object), or `overrides` is not valid JSON.
    """
    if not isinstance(config, Mapping):
        raise LayoutError(f"config must be a dict, got {type(config).__name__}")
    if overrides is None:
        return copy.deepcopy(dict(config))
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise LayoutError(f"hf_overrides is not valid JSON: {e}") from None
    if not isinstance(overrides, Mapping):
        raise LayoutError(f"hf_overrides must be a JSON object (a dict), got {type(overrides).__name__}")
    out = copy.deepcopy(dict(config))
    text = overrides.get("text_config")
    if isinstance(text, Mapping) and "text_config" not in out and "num_hidden_layers" in out:
        # a flat (text-only) config is its own text config: the VL spelling of an override applies to it as well
        overrides = {**{k: v for k, v in overrides.items() if k != "text_config"}, **text}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = apply_hf_overrides(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_m3_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical fields of a MiniMax-M3 (text) config in any spelling.

    Returns a dict with transformers' field names plus resolved ones:
    ``layer_types`` and ``mlp_layer_types`` (tuples, one entry per layer),
    ``disable_index_value`` (tuple of bools: True = the indexer keeps no V),
    ``rope_theta``, ``rotary_dim`` (the channels actually rotated) and
    ``rope_scaling``: None for plain RoPE, or for ``rope_type="yarn"`` (in
    ``rope_parameters`` or ``rope_scaling``, whose keys win) a dict of
    ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
    ``beta_slow`` (defaults 32 and 1), ``mscale``, ``mscale_all_dim``,
    ``attention_factor`` (None: derived) and ``truncate`` (default True),
    resolved as transformers' ``_compute_yarn_parameters`` resolves them.

    Raises:
      LayoutError: naming the field, for a missing layer count or attention
        types, per-layer lists of the wrong length, unknown types, spellings
        that disagree, an unknown RoPE type (naming it), or invalid or
        unknown YaRN parameters.
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
    out["rope_theta"], out["rotary_dim"], out["rope_scaling"] = _rope(config, out["head_dim"])
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
