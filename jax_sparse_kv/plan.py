"""The ``plan`` command: bytes per token per pool and how many tokens fit, or with ``--memory-per-device``
whether a checkpoint's weights and a cache fit a set of devices (the figures: `jax_sparse_kv.planning`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from jax_sparse_kv.layout import SparseKVLayout
from jax_sparse_kv.planning import checkpoint_weight_format, parallel_sizes, parse_bytes, plan_capacity

__all__ = ["run_plan"]


def _size(nbytes: int) -> str:
    """``11599872`` -> ``"11.06 MiB (11,599,872 bytes)"``."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 2 ** (10 * power):
            return f"{nbytes / 2 ** (10 * power):.2f} {unit} ({nbytes:,} bytes)"
    return f"{nbytes:,} bytes"


def _read_config(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path} is not valid JSON: {e}") from None


def run_plan(args: argparse.Namespace, dtypes: Mapping[str, Any], presets: Mapping[str, dict]) -> int:
    """The ``plan`` command; `dtypes`: ``--dtype`` name -> JAX dtype, `presets`: ``--preset`` name -> config."""
    if args.checkpoint:
        config = _read_config(os.path.join(args.checkpoint, "config.json"), "--checkpoint")
        source = args.checkpoint
    elif args.config:
        config = _read_config(args.config, "--config")
        source = args.config
    else:
        config = presets[args.preset]
        source = f"preset {args.preset}"
    if getattr(args, "hf_overrides", None):
        from jax_sparse_kv.hf_config import apply_hf_overrides

        config = apply_hf_overrides(config, args.hf_overrides)
        source += " with --hf-overrides"
    if args.memory_per_device is not None:
        return _plan_fit(args, config, source, dtypes)
    memory = parse_bytes(args.memory)
    layout = SparseKVLayout.from_hf_config(
        config,
        num_slots=args.page_size,  # placeholder: the plan computes capacity from bytes per token
        page_size=args.page_size,
        dtype=dtypes[args.dtype],
        index_dtype=dtypes[args.index_dtype] if args.index_dtype else None,
    )
    plan = plan_capacity(layout, memory, tp=args.tp or 1, context=args.context)
    if plan.tokens == 0:
        need = 2 * args.page_size * plan.total_bytes_per_token
        raise ValueError(
            f"--memory {args.memory} holds no page: a page of {args.page_size} tokens plus the padding "
            f"page need {_size(need)} per device"
        )
    print(
        f"Capacity plan for {source}: {len(layout.layer_ids)} layers "
        f"({len(layout.dense_layer_ids)} dense, {len(layout.k_only_layer_ids)} sparse K-only, "
        f"{len(layout.index_kv_layer_ids)} sparse with index V)"
    )
    print(
        f"main {layout.dtype.name}, index {layout.index_dtype.name}; tensor parallel {args.tp or 1} "
        f"({plan.layout.head_num} of {layout.head_num} KV heads per device, index pools replicated)\n"
    )
    print("Bytes per token, per device:")
    print(plan.table())
    print(
        f"\nIn {args.memory} per device: {plan.tokens:,} tokens "
        f"({plan.tokens // args.page_size:,} pages of {args.page_size})"
    )
    if plan.sequences is not None:
        print(f"  = {plan.sequences:,} sequences of {args.context:,} tokens")
    return 0


def _plan_fit(args: argparse.Namespace, config: dict, source: str, dtypes: Mapping[str, Any]) -> int:
    """``plan --memory-per-device``: weights and cache on ``--devices`` devices; 1 when it does not fit."""
    from jax_sparse_kv.hf_config import parse_m3_config
    from jax_sparse_kv.planning import plan_weights
    from jax_sparse_kv.serving.sampler import penalty_state_bytes

    memory = parse_bytes(args.memory_per_device)
    if not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    c = argparse.Namespace(**parse_m3_config(config))
    weights = args.weights or checkpoint_weight_format(config)
    devices = args.devices
    # serve's rule: attention heads on tp (at most the KV heads), dp groups of them, experts over every device
    tp, dp = parallel_sizes(devices, c.num_key_value_heads, c.num_attention_heads, args.tp, args.dp)
    ep = args.ep or devices
    if devices % ep or c.num_local_experts % ep:
        raise ValueError(f"--ep {ep} must divide --devices {devices} and the {c.num_local_experts} experts")
    w = plan_weights(c, weights, tp=tp, ep=ep)
    usable = int(memory * args.memory_utilization)
    layout = SparseKVLayout.from_hf_config(
        config,
        num_slots=args.page_size,
        page_size=args.page_size,
        dtype=dtypes[args.dtype],
        index_dtype=dtypes[args.index_dtype] if args.index_dtype else None,
    )
    params = sum(w.params.values())
    print(
        f"Fit plan for {source}: {params / 1e9:.2f}B parameters (text model), {weights} weights: "
        f"{_size(w.total_bytes)} in all"
    )
    print(
        f"{devices} devices x {args.memory_per_device} (x {args.memory_utilization:g} usable = {_size(usable)}); "
        f"attention on {tp} (KV heads split {tp} ways{f', {dp} data-parallel groups' if dp > 1 else ''}), "
        f"routed experts on {ep}"
    )
    print(f"  weights per device: {_size(w.per_device_bytes)}")
    # the engine's other state for its life: each group's penalty counts on its devices (serve's --max-seqs)
    penalties = penalty_state_bytes(args.max_seqs, c.vocab_size)
    print(f"  penalty counts per device: {_size(penalties)} (({args.max_seqs} + 1) rows x {c.vocab_size:,} ids)")
    left = usable - w.per_device_bytes - penalties
    if left <= 0:
        print(
            f"does not fit: the weights and penalty counts need {_size(w.per_device_bytes + penalties)} per "
            f"device, more than the {_size(usable)} usable"
            + ("" if ep == devices else f" (experts over all {devices} devices: --ep {devices})")
        )
        return 1
    plan = plan_capacity(layout, left, tp=tp, context=args.context)
    print(
        f"  KV cache per device: {_size(left)}, {plan.total_bytes_per_token:,} bytes per token "
        f"({layout.dtype.name} main, {layout.index_dtype.name} index)"
    )
    if plan.tokens == 0:
        print(f"does not fit: {_size(left)} per device left for the cache holds no page of {args.page_size} tokens")
        return 1
    per_group = f" per group, {plan.tokens * dp:,} in all ({dp} groups, each its own sequences)" if dp > 1 else ""
    print(
        f"  tokens of cache: {plan.tokens:,} ({plan.tokens // args.page_size:,} pages of {args.page_size}){per_group}"
        + (f" = {plan.sequences:,} sequences of {args.context:,} tokens" if plan.sequences is not None else "")
        + (f" per group, {plan.sequences * dp:,} in all" if dp > 1 and plan.sequences is not None else "")
    )
    if args.context is not None and plan.sequences == 0:
        print(f"does not fit: not one sequence of {args.context:,} tokens")
        return 1
    return 0
