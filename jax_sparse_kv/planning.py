"""Capacity planning: bytes per token per pool, and how many tokens fit in memory.

Importing this module does not import JAX (the command line's ``--help`` stays fast).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax_sparse_kv.layout import SparseKVLayout

__all__ = ["MINIMAX_M3_LIKE_CONFIG", "CapacityPlan", "plan_capacity", "parse_bytes"]

#: A MiniMax-M3-like shape: 60 layers, 0-2 dense, 3-59 sparse and K-only,
#: 64 query / 4 KV heads of 128 (the release's config.json), index heads of 128.
MINIMAX_M3_LIKE_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 60,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_size": 6144,
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

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
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
