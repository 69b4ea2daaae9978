"""Capacity planning: bytes per token per pool, and how many tokens fit in memory.

Importing this module does not import JAX (the command line's ``--help`` stays fast).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax_sparse_kv.layout import SparseKVLayout

__all__ = [
    "MINIMAX_M3_LIKE_CONFIG",
    "CapacityPlan",
    "plan_capacity",
    "parse_bytes",
    "WEIGHT_FORMATS",
    "parameter_shapes",
    "WeightPlan",
    "plan_weights",
    "parallel_sizes",
    "checkpoint_weight_format",
]

#: MiniMax-M3's text model as released (config.json of MiniMax-M3-MXFP8, checkpoint spelling): 60 layers,
#: 0-2 dense attention + dense MLP 12288, 3-59 sparse (K-only index) + MoE of 128 experts x 3072 top-4 and
#: one shared 3072; 64 query / 4 KV heads of 128, rotary 64, theta 5e6; vocab 200064; 1M positions.
MINIMAX_M3_LIKE_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 60,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_size": 6144,
    "vocab_size": 200064,
    "intermediate_size": 3072,
    "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "rotary_dim": 64,
    "rope_theta": 5_000_000.0,
    "max_position_embeddings": 1_048_576,
    "moe_layer_freq": [0] * 3 + [1] * 57,
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
        "sparse_block_size": 128,
        "sparse_topk_blocks": 16,
        "sparse_attention_freq": [0] * 3 + [1] * 57,
        "sparse_disable_index_value": [0] * 3 + [1] * 57,
    },
}

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)([a-z]*)$")


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (case-insensitive).

    A unit is required: ``"80"`` is refused rather than read as 80 bytes (write ``"80B"`` for bytes).
    """
    s = str(text).strip().lower().replace(" ", "")
    m = _SIZE.match(s)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}; use e.g. 80GiB or 40GB")
    number, unit = m.groups()
    value = float(number)
    if not unit:
        raise ValueError(
            f"memory size {text!r} has no unit; write e.g. {number}GiB or {number}GB ({number}B for bytes)"
        )
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {text!r}; units: {_UNIT_NAMES}")
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """What fits on one device. ``bytes_per_token`` is by pool name, per device."""

    layout: SparseKVLayout
    tp: int
    memory_bytes: int
    bytes_per_token: dict[str, int]
    tokens: int  # whole pages only
    sequences: int | None  # at `context` tokens each
    context: int | None

    @property
    def total_bytes_per_token(self) -> int:
        return sum(self.bytes_per_token.values())

    def table(self) -> str:
        lines = [f"{'pool':<12}{'layers':>7}{'bytes/token':>13}{'share':>8}"]
        ids = self.layout.pool_layer_ids()
        for name, b in self.bytes_per_token.items():
            share = b / self.total_bytes_per_token if self.total_bytes_per_token else 0.0
            lines.append(f"{name:<12}{len(ids[name]):>7}{b:>13,}{share:>8.1%}")
        lines.append(f"{'total':<12}{'':>7}{self.total_bytes_per_token:>13,}")
        return "\n".join(lines)


def plan_capacity(layout: SparseKVLayout, memory_bytes: int, tp: int = 1, context: int | None = None) -> CapacityPlan:
    """Tokens (and sequences of `context` tokens) that fit in `memory_bytes` per device.

    `layout.head_num` is the model's KV head count; with tensor parallelism
    ``tp`` each device holds ``head_num / tp`` main heads, while the one-head
    index pools are replicated on every device. The padding page is counted.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if layout.head_num % tp:
        raise ValueError(f"head_num={layout.head_num} is not divisible by tp={tp}")
    if memory_bytes <= 0:
        raise ValueError(f"memory must be positive, got {memory_bytes}")
    if context is not None and context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    per_device = dataclasses.replace(layout, head_num=layout.head_num // tp)
    bpt = per_device.bytes_per_token()
    total = sum(bpt.values())
    rows = memory_bytes // total
    pages = max(rows // layout.page_size - 1, 0)  # one page is the padding page
    tokens = pages * layout.page_size
    sequences = None if context is None else tokens // context
    return CapacityPlan(per_device, tp, memory_bytes, bpt, tokens, sequences, context)


# ---------------------------------------------------------------------- weights


#: bytes per parameter of a quantized linear weight, by format (values + scales); others stay bf16
WEIGHT_FORMATS: dict[str, float] = {
    "bf16": 2.0,
    "mxfp8": 1.0 + 1.0 / 32,  # float8_e4m3fn values + one uint8 E8M0 exponent per 32 inputs
    "fp8": 1.0 + 4.0 / (128 * 128),  # float8_e4m3fn values + one float32 scale per 128 x 128 block
}


def parameter_shapes(config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """transformers name -> (shape, kind) of every parameter of the text model, from its config alone.

    `config`: a `jax_sparse_kv.nn.MiniMaxM3Config`-like object (attributes of `parse_m3_config`'s names).
    ``kind``: ``"expert"`` (routed experts), ``"linear"`` (another quantizable projection), or ``"plain"``
    (embeddings, LM head, norms, router: unquantized in MiniMax-M3's MXFP8 release). The same shapes as
    ``nn.params.hf_params(MiniMaxM3(config))`` (a test checks it).
    """
    c = config
    H, D, Di = c.hidden_size, c.head_dim, c.index_head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((c.vocab_size, H), "plain")}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = ((H,), "plain")
        out[p + "post_attention_layernorm.weight"] = ((H,), "plain")
        a = p + "self_attn."
        out[a + "q_proj.weight"] = ((c.num_attention_heads * D, H), "linear")
        out[a + "k_proj.weight"] = ((c.num_key_value_heads * D, H), "linear")
        out[a + "v_proj.weight"] = ((c.num_key_value_heads * D, H), "linear")
        out[a + "o_proj.weight"] = ((H, c.num_attention_heads * D), "linear")
        out[a + "q_norm.weight"] = ((D,), "plain")
        out[a + "k_norm.weight"] = ((D,), "plain")
        if c.layer_types[layer] != "full_attention":
            i = a + "indexer."
            out[i + "q_proj.weight"] = ((c.index_n_heads * Di, H), "linear")
            out[i + "k_proj.weight"] = ((Di, H), "linear")
            out[i + "q_norm.weight"] = ((Di,), "plain")
            out[i + "k_norm.weight"] = ((Di,), "plain")
            if not c.disable_index_value[layer]:
                out[i + "v_proj.weight"] = ((Di, H), "linear")
                out[i + "o_proj.weight"] = ((H, c.index_n_heads * Di), "linear")
        m = p + "mlp."
        if c.mlp_layer_types[layer] == "dense":
            out[m + "gate_up_proj.weight"] = ((2 * c.dense_intermediate_size, H), "linear")
            out[m + "down_proj.weight"] = ((H, c.dense_intermediate_size), "linear")
        else:
            E, inter, shared = c.num_local_experts, c.intermediate_size, c.shared_intermediate_size
            out[m + "gate.weight"] = ((E, H), "plain")
            out[m + "gate.e_score_correction_bias"] = ((E,), "plain")
            out[m + "experts.gate_up_proj"] = ((E, 2 * inter, H), "expert")
            out[m + "experts.down_proj"] = ((E, H, inter), "expert")
            out[m + "shared_experts.gate_up_proj.weight"] = ((2 * shared, H), "linear")
            out[m + "shared_experts.down_proj.weight"] = ((H, shared), "linear")
    out["model.norm.weight"] = ((H,), "plain")
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((c.vocab_size, H), "plain")
    return out


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """Weight bytes in all and per device for one sharding: attention (and dense MLPs, norms, embeddings)
    on ``tp`` devices (q/k/v/o split by head, the rest replicated), routed experts over ``ep`` devices."""

    weights: str
    tp: int
    ep: int
    params: dict[str, int]  # by kind
    total_bytes: int
    per_device_bytes: int


def plan_weights(config: Any, weights: str = "bf16", tp: int = 1, ep: int = 1) -> WeightPlan:
    """Bytes of the text model's weights in format `weights` (`WEIGHT_FORMATS`), in all and on one device."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}: known formats {', '.join(WEIGHT_FORMATS)}")
    for name, size, count in (("tp", tp, config.num_key_value_heads), ("ep", ep, config.num_local_experts)):
        if size < 1 or count % size:
            raise ValueError(f"{name}={size} must divide {count} ({'KV heads' if name == 'tp' else 'experts'})")
    quant = WEIGHT_FORMATS[weights]
    params = {"expert": 0, "linear": 0, "plain": 0}
    total = per_device = 0.0
    for name, (shape, kind) in parameter_shapes(config).items():
        n = 1
        for d in shape:
            n *= d
        params[kind] += n
        b = n * (2.0 if kind == "plain" else quant)
        total += b
        split = (
            ep
            if kind == "expert"
            else tp
            if ".self_attn.q_proj" in name
            or ".self_attn.k_proj" in name
            or ".self_attn.v_proj" in name
            or ".self_attn.o_proj" in name
            else 1
        )
        per_device += b / split
    return WeightPlan(weights, tp, ep, params, int(total), int(per_device))


def parallel_sizes(
    devices: int, num_key_value_heads: int, num_attention_heads: int, tp: int | None = None, dp: int | None = None
) -> tuple[int, int]:
    """``(tp, dp)`` for `devices`: attention heads split ``tp`` ways, ``dp`` groups of them; ``tp * dp == devices``.

    The one rule `plan` and `serve` share. Defaults: ``tp`` the largest count dividing the devices and the KV
    (and query) heads, ``dp`` the rest; one given, the other follows. Routed experts go over all ``devices``
    (`jax_sparse_kv.nn.parallel`). `ValueError` naming the flags when the product is not the device count or
    ``tp`` does not divide the heads.
    """
    import math

    if tp is None and dp is None:
        tp = math.gcd(devices, num_key_value_heads, num_attention_heads)
    for flag, given, other in (("--tensor-parallel-size", tp, dp), ("--data-parallel-size", dp, tp)):
        if other is None and given is not None and (given < 1 or devices % given):
            raise ValueError(f"{flag} {given} does not divide the {devices} devices")
    if tp is None:
        tp = devices // dp
    if dp is None:
        dp = devices // tp
    if tp < 1 or dp < 1 or tp * dp != devices:
        raise ValueError(f"--tensor-parallel-size {tp} x --data-parallel-size {dp} must equal the {devices} devices")
    if num_key_value_heads % tp or num_attention_heads % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} must divide the {num_key_value_heads} KV heads and the "
            f"{num_attention_heads} query heads"
        )
    return tp, dp


def checkpoint_weight_format(config: dict) -> str:
    """The weight format (`WEIGHT_FORMATS`) a config.json declares: its quantization_config's method, else bf16."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return "bf16"
    method = quant.get("quant_method")
    if method not in ("fp8", "mxfp8"):
        raise ValueError(f"quantization_config.quant_method={method!r}: plan knows fp8 and mxfp8")
    return method
