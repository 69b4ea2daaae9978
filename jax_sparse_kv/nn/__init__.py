"""Flax NNX modules: MiniMax-M3 (text + vision) reading and writing the cache, jitted steps, checkpoints.

Imports run one way: ``model`` (the modules, top to bottom) -> ``weights`` (loading and saving checkpoints) ->
``parallel`` (shardings) -> ``params`` (parameters under their checkpoint names; quantizing them in place) ->
``quant`` (block-fp8 formats); ``config``, ``init``, ``precision``, ``vision`` below the model; ``decode`` (jitted
steps) and ``eagle3`` (draft heads) above it.
"""

from jax_sparse_kv.nn.config import MiniMaxM3Config, VisionConfig, YarnScaling, demo_config, tiny_config
from jax_sparse_kv.nn.decode import DecodeSession, make_forward, make_step
from jax_sparse_kv.nn.eagle3 import Eagle3Config, Eagle3Draft
from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.nn.precision import KVPrecision

__all__ = [
    "MiniMaxM3Config",
    "VisionConfig",
    "YarnScaling",
    "MiniMaxM3",
    "demo_config",
    "tiny_config",
    "KVPrecision",
    "make_step",
    "make_forward",
    "DecodeSession",
    "Eagle3Draft",
    "Eagle3Config",
]
