"""Flax NNX modules: a small MiniMax-like decoder that reads and writes the cache."""

from jax_sparse_kv.nn.config import ModelConfig, demo_config
from jax_sparse_kv.nn.decode import DecodeSession, make_forward, make_step
from jax_sparse_kv.nn.layers import KVPrecision
from jax_sparse_kv.nn.model import MiniMaxLikeModel

__all__ = [
    "ModelConfig",
    "demo_config",
    "MiniMaxLikeModel",
    "KVPrecision",
    "make_step",
    "make_forward",
    "DecodeSession",
]
