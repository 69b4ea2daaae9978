"""A model's parameters under their checkpoint names, and how they are held (float, or fp8 + block scales).

The model (`jax_sparse_kv.nn.model`) declares which of its parameters may be held quantized: a module's
``quantizable`` attribute names them (`Linear`: ``weight``; ``Experts``: both stacks) and its ``quant``
(`jax_sparse_kv.nn.quant.BlockQuant` or None) says how they are held now. This module names every parameter as
transformers' checkpoint does (``model.layers.{l}.self_attn.q_proj.weight``) and changes how they are held; it
knows no model class. Within `jax_sparse_kv.nn` imports run one way:
model -> weights (loading, saving) -> parallel (shardings) -> params -> quant.

Every function takes the model (`jax_sparse_kv.nn.MiniMaxM3`, a whole model or a pipeline stage) first::

    from jax_sparse_kv.nn import params
    params.quantize_weights(model, MXFP8)          # fp8 values + E8M0 scales, in place
    params.hf_params(model)["lm_head.weight"]     # an nnx.Variable
    model.weight_bytes()                          # = params.weight_bytes(model)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv.nn.quant import BlockQuant, quantize

__all__ = [
    "SCALE_SUFFIX",
    "named_params",
    "hf_params",
    "quantizable_params",
    "quantize_param",
    "quantize_weights",
    "set_quantized_dot",
    "weight_bytes",
]

#: The checkpoint's name for a quantized weight's block scales: ``<weight name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"

#: Top-level modules that transformers' checkpoint keeps under ``model.`` (the LM head stays at the top).
_UNDER_MODEL = ("embed_tokens", "norm", "vision_tower", "multi_modal_projector")


def named_params(model: nnx.Module) -> dict[str, tuple[nnx.Module, str, nnx.Variable]]:
    """transformers' key -> (owning module, attribute, parameter), for every parameter of `model`.

    Layers are named by absolute id (``model.layer_ids``: a pipeline stage holds some layers only). A quantized
    weight comes with its scales, ``<name>_scale_inv``.
    """
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}
    out = {}
    for path, node in nodes.items():
        if not isinstance(node, nnx.Variable):
            continue
        parts = [str(p) for p in path]
        if parts[0] == "layers":
            parts = ["model", "layers", str(model.layer_ids[int(parts[1])]), *parts[2:]]
        elif parts[0] in _UNDER_MODEL:
            parts = ["model", *parts]
        out[".".join(parts)] = (nodes[path[:-1]], str(path[-1]), node)
    return out


def hf_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    """transformers' key -> parameter (``model.layers.{l}.self_attn.q_proj.weight``, ...): `named_params` without
    the owners."""
    return {name: var for name, (_, _, var) in named_params(model).items()}


def _quantizable(module: nnx.Module, attr: str) -> bool:
    return attr in getattr(module, "quantizable", ())


def quantizable_params(model: nnx.Module) -> list[str]:
    """Names of the parameters that may be held as fp8 + block scales: the text model's projections (`Linear`
    weights: attention, indexer, dense and shared MLPs, LM head) and the routed expert stacks."""
    return [name for name, (module, attr, _) in named_params(model).items() if _quantizable(module, attr)]


def quantize_param(
    model: nnx.Module,
    name: str,
    quant: BlockQuant,
    values: Any = None,
    scale: Any = None,
    dtype: Any = jnp.float8_e4m3fn,
) -> None:
    """Holds parameter `name` (one of `quantizable_params`) as fp8 `values` and block `scale`
    (`jax_sparse_kv.nn.quant` formats), in place; with ``values=None`` as shapes only (for loading).

    Raises `ValueError` for a name that is not quantizable, a module already held in another format, or values /
    scales whose shapes or dtype do not fit. An expert module's two stacks share one format: quantize both.
    """
    named = named_params(model)
    if name not in named or not _quantizable(*named[name][:2]):
        raise ValueError(f"{name} is not a quantizable parameter of this model")
    module, attr, var = named[name]
    if module.quant is not None and module.quant != quant:
        raise ValueError(f"{name}: its module is already quantized as {module.quant}, not {quant}")
    shape = tuple(var.shape)
    if values is None:
        values = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        scale = jax.ShapeDtypeStruct(quant.scale_shape(shape), quant.scale_dtype)
    else:
        values, scale = jnp.asarray(values), jnp.asarray(scale)
        if values.shape != shape or scale.shape != quant.scale_shape(shape) or scale.dtype != quant.scale_dtype:
            raise ValueError(
                f"{name}: values {values.shape} and {scale.dtype} scale {scale.shape} do not fit {shape} in "
                f"{quant}: expected scale {quant.scale_shape(shape)} {quant.scale_dtype}"
            )
    setattr(module, attr, nnx.Param(values))
    setattr(module, attr + SCALE_SUFFIX, nnx.Param(scale))
    module.quant = quant


def quantize_weights(model: nnx.Module, quant: BlockQuant, include_lm_head: bool = False) -> nnx.Module:
    """Quantizes every `quantizable_params` weight (the LM head only if asked: releases keep it unquantized)
    with `jax_sparse_kv.nn.quant.quantize`, in place; returns the model."""
    params = hf_params(model)
    for name in quantizable_params(model):
        if name == "lm_head.weight" and not include_lm_head:
            continue
        values, scale = quantize(np.asarray(jax.device_get(params[name][...])), quant)
        quantize_param(model, name, quant, values, scale)
    return model


def set_quantized_dot(model: nnx.Module, dot: str) -> nnx.Module:
    """How quantized projections multiply (`jax_sparse_kv.nn.quant.BlockQuant.dot`): ``"dequantize"`` (the
    default, exact) or ``"mxfp8_dot"`` (MXFP8 weights: activations quantized too, one block-scaled fp8 dot per
    projection). Expert stacks always dequantize (they do not read ``dot``). In place; returns the model.

    Raises `ValueError` for another `dot`, or ``"mxfp8_dot"`` on weights that are not MXFP8.
    """
    for module in [node for _, node in nnx.iter_graph(model) if getattr(node, "quant", None) is not None]:
        module.quant = dataclasses.replace(module.quant, dot=dot)
    return model


def weight_bytes(model: nnx.Module) -> int:
    """Bytes the parameters take in device memory, all shards together (a replicated parameter counts once)."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in hf_params(model).values())
