"""`MiniMaxM3Config`: the static shape of a MiniMax-M3 text model, in the checkpoint's names.

Field names are transformers' (`MiniMaxM3VLTextConfig`), so a reader can put
this file next to a `config.json`. `from_hf` reads every spelling through
`jax_sparse_kv.hf_config.parse_m3_config`, the same parser as
`SparseKVLayout.from_hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_sparse_kv.hf_config import (
    DENSE,
    INDEX_FIELD_SPELLINGS,
    SPARSE,
    apply_hf_overrides,
    context_length,
    eos_ids,
    parse_m3_config,
)
from jax_sparse_kv.layout import SparseKVLayout

__all__ = ["MiniMaxM3Config", "VisionConfig", "YarnScaling", "demo_config", "tiny_config", "tiny_vision_config"]


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (``rope_type="yarn"``), the parameters of transformers' ``_compute_yarn_parameters``.

    The rotated channels' frequencies blend interpolation (divided by ``factor``) and extrapolation
    (unchanged) over a ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times in
    ``original_max_position_embeddings`` positions (rounded outwards when ``truncate``); cos and sin are
    multiplied by `attention_scaling`. The model then serves `MiniMaxM3Config.context_length` =
    ``original_max_position_embeddings * factor`` positions. Built from config.json by
    `MiniMaxM3Config.from_hf` (validated there: factor >= 1, beta_fast >= beta_slow, ...).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor (and mscale / mscale_all_dim)
    truncate: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> YarnScaling:
        """From `parse_m3_config`'s resolved ``rope_scaling`` dict (``rope_type`` ignored)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def to_hf(self) -> dict[str, Any]:
        """The yarn keys of transformers' ``rope_parameters`` (no ``rope_theta`` / ``partial_rotary_factor``)."""
        d: dict[str, Any] = {"rope_type": "yarn"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "truncate" and value):  # truncate only when off
                d[f.name] = value
        return d

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin: ``attention_factor``, or ``0.1 * ln(factor) + 1`` (1 for factor <= 1),
        or with both ``mscale`` and ``mscale_all_dim`` non-zero the ratio of that formula scaled by each."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(m: float = 1.0) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.mscale) / mscale(self.mscale_all_dim))
        return mscale()

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        """``[rotary_dim // 2]`` float32 inverse frequencies, computed in transformers' order and precision."""
        dim = rotary_dim

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        # theta ** (i / dim) correctly rounded to float32, as torch's powf gives it (NumPy >= 2.4's float32 power
        # is 1 ulp off for 7 of 32 exponents at theta 5e6, and positions near 1M multiply that into the angle)
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        pos_freqs = (np.float64(np.float32(theta)) ** exponents.astype(np.float64)).astype(np.float32)
        extrapolation = np.float32(1.0) / pos_freqs
        interpolation = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        keep = np.float32(1.0) - ramp  # 1: the channel keeps its original frequency
        return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower and projector of MiniMax-M3 VL (transformers' `MiniMaxM3VLVisionConfig` + VL fields).

    A CLIP-like ViT (``num_hidden_layers`` pre-LN layers, 3-D partial RoPE over
    (t, h, w) patch positions, no post-norm) over ``temporal_patch_size x
    patch_size x patch_size`` patches of ``num_channels``; the projector maps
    each patch to the text width through ``projector_hidden_size``, then merges
    ``spatial_merge_size ** 2`` neighbouring patches into one text token.
    ``image_token_id`` is the placeholder the prompt holds (one per merged
    patch after expansion); ``video_token_id`` a video's placeholder (transformers'
    ``video_token_index``); ``image_start_token_id`` / ``image_end_token_id``
    bracket each image (and each temporal patch of a video) (None: not named by config.json; `MiniMaxM3.from_pretrained`
    fills them from the checkpoint's tokenizer).
    """

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    projector_hidden_size: int = 6144
    projector_bias: bool = True
    image_token_id: int = 200025
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_token_id: int = 200026

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision hidden_size={self.hidden_size} must be a multiple of num_attention_heads="
                f"{self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        """Channels per head the 3-D RoPE rotates: 3 axes x ``2 * ((head_dim // 3) // 2)`` (the rest pass)."""
        return 3 * 2 * ((self.head_dim // 3) // 2)

    @property
    def patch_dim(self) -> int:
        """Width of one row of ``pixel_values``: ``channels * temporal * patch * patch`` (1176 for M3)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> VisionConfig | None:
        """From a VL `config.json` dict (transformers' or the release's spelling); None without ``vision_config``.

        transformers: ``vision_config`` (with ``rope_parameters.rope_theta``,
        ``spatial_merge_size``), ``projector_hidden_size``,
        ``image_token_index``/``image_token_id``. The release: ``vision_config``
        with ``rope_theta``, ``img_token_compression_config`` (its
        ``spatial_merge_size`` / ``merge_size``), ``multimodal_projector_bias``.
        """
        vision = config.get("vision_config")
        if vision is None:
            return None
        if not isinstance(vision, Mapping):
            raise ValueError(f"vision_config must be a dict, got {type(vision).__name__}")
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in vision:
                fields[f.name] = vision[f.name]
        rope = vision.get("rope_parameters")
        if isinstance(rope, Mapping):
            if rope.get("rope_type", "axial") not in ("axial", "default"):
                raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not supported")
            if "rope_theta" in rope:
                fields["rope_theta"] = rope["rope_theta"]
        compression = config.get("img_token_compression_config")
        if isinstance(compression, Mapping):
            for key in ("spatial_merge_size", "merge_size"):
                if key in compression:
                    fields["spatial_merge_size"] = compression[key]
        text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
        fields["projector_hidden_size"] = config.get(
            "projector_hidden_size", vision.get("projector_hidden_size", text.get("hidden_size", 6144))
        )
        if "multimodal_projector_bias" in config:
            fields["projector_bias"] = bool(config["multimodal_projector_bias"])
        for key in ("image_token_index", "image_token_id"):
            if config.get(key) is not None:
                fields["image_token_id"] = config[key]
        for key in ("video_token_index", "video_token_id"):
            if config.get(key) is not None:
                fields["video_token_id"] = config[key]
        for ours, names in (
            ("image_start_token_id", ("image_start_token_id", "vision_start_token_id")),
            ("image_end_token_id", ("image_end_token_id", "vision_end_token_id")),
        ):
            for key in names:
                if config.get(key) is not None:
                    fields[ours] = config[key]
        if vision.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"vision_config.hidden_act={vision['hidden_act']!r}: only exact GELU is supported")
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """transformers' ``vision_config`` dict (the VL fields are the caller's: see `MiniMaxM3Config.to_hf_vl`)."""
        names = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_channels",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "layer_norm_eps",
        )
        d = {n: getattr(self, n) for n in names}
        d["hidden_act"] = "gelu"
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        d["model_type"] = "minimax_m3_vl_vision"
        return d


@dataclasses.dataclass(frozen=True)
class MiniMaxM3Config:
    """Sizes, per-layer attention and MLP types, indexer and RoPE settings of MiniMax-M3.

    ``layer_types[i]`` is ``"full_attention"`` (dense) or ``"minimax_m3_sparse"``
    (lightning indexer + block-sparse attention); ``mlp_layer_types[i]`` is
    ``"dense"`` (SwiGLU-OAI MLP of ``dense_intermediate_size``) or ``"sparse"``
    (MoE). ``disable_index_value[i]`` False keeps SGLang's optional index-V
    branch on sparse layer ``i`` (off everywhere in M3). ``rotary_dim`` is the
    number of channels RoPE rotates (resolved from ``partial_rotary_factor``).
    ``rope_scaling`` is None (plain RoPE) or a `YarnScaling` (config.json's
    ``rope_type="yarn"``; a dict of its fields is accepted too), applied to
    those ``rotary_dim`` channels as transformers does; `context_length` is
    then the scaled context.
    """

    num_hidden_layers: int = 4
    layer_types: tuple[str, ...] = (DENSE, SPARSE, SPARSE, SPARSE)
    mlp_layer_types: tuple[str, ...] = ("dense", "sparse", "sparse", "sparse")
    disable_index_value: tuple[bool, ...] = (True, True, True, True)
    vocab_size: int = 256
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rotary_dim: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    intermediate_size: int = 32
    dense_intermediate_size: int = 96
    shared_intermediate_size: int = 32
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    index_n_heads: int = 2
    index_head_dim: int = 16
    index_block_size: int = 8
    index_topk_blocks: int = 3
    index_local_blocks: int = 1
    max_position_embeddings: int = 524288
    rope_scaling: YarnScaling | None = None  # YaRN; None: plain RoPE
    eos_token_id: tuple[int, ...] = ()  # token ids that end generation (config.json's int or list)
    vision: VisionConfig | None = None  # the vision tower + projector of a VL checkpoint; None: text only

    def __post_init__(self) -> None:
        for name in ("layer_types", "mlp_layer_types", "disable_index_value", "eos_token_id"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", YarnScaling.from_dict(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"rope_scaling must be a YarnScaling, a dict or None, got {self.rope_scaling!r}")
        checked = parse_m3_config(self.to_hf())  # one set of rules for every spelling
        if checked["rope_scaling"] is not None:  # resolved as config.json would be (beta 0 -> its default, ...)
            checked["rope_scaling"] = YarnScaling.from_dict(checked["rope_scaling"])
            object.__setattr__(self, "rope_scaling", checked["rope_scaling"])
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        wrong = {k: (mine[k], v) for k, v in checked.items() if k in mine and mine[k] != v}
        if wrong:
            raise ValueError(f"inconsistent MiniMaxM3Config: {wrong}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.sparse_layer_ids:
            a, b = self.index_n_heads, self.num_key_value_heads
            if a % b and b % a:
                raise ValueError(f"index_n_heads={a} and num_key_value_heads={b}: one must divide the other")
            if self.num_attention_heads % a:
                raise ValueError(
                    f"num_attention_heads={self.num_attention_heads} must be a multiple of index_n_heads={a}"
                )
            if self.index_local_blocks < 1 or self.index_topk_blocks < self.index_local_blocks:
                raise ValueError(
                    f"index_local_blocks={self.index_local_blocks} must be >= 1 and <= "
                    f"index_topk_blocks={self.index_topk_blocks}"
                )
        if self.num_experts_per_tok > self.num_local_experts and "sparse" in self.mlp_layer_types:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} > num_local_experts={self.num_local_experts}"
            )

    # ------------------------------------------------------------ reading

    @classmethod
    def from_hf(
        cls, config: Mapping[str, Any], config_overrides: Mapping[str, Any] | str | None = None
    ) -> MiniMaxM3Config:
        """From a `config.json` dict in any spelling (flat, ``text_config``, checkpoint).

        `config_overrides` (a dict or its JSON text) is merged in first, as vLLM's ``--hf-overrides``
        (`jax_sparse_kv.hf_config.apply_hf_overrides`): e.g. ``{"text_config": {"rope_scaling":
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 524288}}}``.
        """
        if config_overrides is not None:
            config = apply_hf_overrides(config, config_overrides)
        fields = parse_m3_config(config)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in names}, vision=VisionConfig.from_hf(config))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, config_overrides: Mapping[str, Any] | str | None = None
    ) -> MiniMaxM3Config:
        """Reads ``path/config.json`` (or `path` itself if it is a file), with `config_overrides` merged in.

        `config_overrides`: a dict or its JSON text, merged as vLLM's ``--hf-overrides`` (see `from_hf`).

        ``eos_token_id`` is config.json's and, in a directory, that of ``generation_config.json`` (an int or a
        list) after it, as transformers' ``GenerationConfig`` and vLLM read it (the MiniMax-M3 release names its
        EOS id 200020 only there).
        """
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path} is not a checkpoint directory: no config.json found")
        with open(file) as f:
            config = cls.from_hf(json.load(f), config_overrides)
        generation = os.path.join(os.path.dirname(file), "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                extra = eos_ids(json.load(f).get("eos_token_id"), "generation_config.json")
            merged = config.eos_token_id + tuple(t for t in dict.fromkeys(extra) if t not in config.eos_token_id)
            config = dataclasses.replace(config, eos_token_id=merged)
        return config

    @property
    def context_length(self) -> int:
        """Positions this model serves: ``original_max_position_embeddings * factor`` with YaRN (vLLM's
        ``max_model_len`` for such a config), else ``max_position_embeddings``."""
        scaling = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
        return context_length({"rope_scaling": scaling, "max_position_embeddings": self.max_position_embeddings})

    def text_only(self) -> MiniMaxM3Config:
        """This config without its vision tower."""
        return dataclasses.replace(self, vision=None)

    def to_hf(self) -> dict[str, Any]:
        """transformers' flat text spelling (`MiniMaxM3VLTextConfig(**config.to_hf())` builds the same text model)."""
        d = dataclasses.asdict(self)
        d.pop("vision")
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        disable = d.pop("disable_index_value")
        d.pop("rope_theta")
        d.pop("rope_scaling")
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
        }
        if self.rope_scaling is not None:
            d["rope_parameters"].update(self.rope_scaling.to_hf())
        if not all(disable):  # transformers has no index-V branch: keep it in SGLang's spelling
            d["sparse_attention_config"] = {"sparse_disable_index_value": [int(x) for x in disable]}
        d["eos_token_id"] = list(self.eos_token_id) or None
        d["model_type"] = "minimax_m3_vl_text"
        return d

    def to_hf_vl(self) -> dict[str, Any]:
        """transformers' VL spelling (`MiniMaxM3VLConfig(**config.to_hf_vl())`); needs a vision config."""
        if self.vision is None:
            raise ValueError("to_hf_vl needs a config with a vision tower (config.vision is None)")
        v = self.vision
        d: dict[str, Any] = {
            "model_type": "minimax_m3_vl",
            "text_config": self.to_hf(),
            "vision_config": v.to_hf(),
            "image_token_index": v.image_token_id,
            "video_token_index": v.video_token_id,
            "projector_hidden_size": v.projector_hidden_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if not v.projector_bias:
            d["multimodal_projector_bias"] = False
        for name in ("image_start_token_id", "image_end_token_id"):
            if getattr(v, name) is not None:
                d[name] = getattr(v, name)
        return d

    def to_checkpoint_dict(self) -> dict[str, Any]:
        """The original checkpoint's spelling (``sparse_attention_config``, ``moe_layer_freq``, ``rotary_dim``)."""
        d = self.to_hf()
        for name in ("layer_types", "mlp_layer_types", "rope_parameters", "sparse_attention_config", "model_type"):
            d.pop(name, None)
        sparse = {legacy: d.pop(flat) for flat, legacy in INDEX_FIELD_SPELLINGS.items()}
        sparse["sparse_attention_freq"] = [int(t == SPARSE) for t in self.layer_types]
        sparse["sparse_disable_index_value"] = [int(x) for x in self.disable_index_value]
        d["sparse_attention_config"] = sparse
        d["moe_layer_freq"] = [int(t == "sparse") for t in self.mlp_layer_types]
        d["rope_theta"] = self.rope_theta
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf()
        d["model_type"] = "minimax_m3"
        if self.vision is not None:  # the release's VL spelling: vision fields beside the text ones
            v = self.vision
            vision = v.to_hf()
            vision.pop("rope_parameters")
            vision.pop("spatial_merge_size")
            vision["rope_theta"] = v.rope_theta
            d["vision_config"] = vision
            d["img_token_compression_config"] = {"spatial_merge_size": v.spatial_merge_size}
            d["projector_hidden_size"] = v.projector_hidden_size
            d["multimodal_projector_bias"] = v.projector_bias
            d["image_token_index"] = v.image_token_id
            d["video_token_index"] = v.video_token_id
            for name in ("image_start_token_id", "image_end_token_id"):
                if getattr(v, name) is not None:
                    d[name] = getattr(v, name)
        return d

    # ------------------------------------------------------------ layers

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers))

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != SPARSE)

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SPARSE)

    @property
    def k_only_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in self.sparse_layer_ids if self.disable_index_value[i])

    def layout(self, num_slots: int, page_size: int, dtype: Any = "float32", **overrides: Any) -> SparseKVLayout:
        """The cache layout this model reads and writes (stage, index dtype via `overrides`)."""
        return SparseKVLayout(
            dense_layer_ids=self.dense_layer_ids,
            sparse_layer_ids=self.sparse_layer_ids,
            k_only_layer_ids=self.k_only_layer_ids,
            num_slots=num_slots,
            page_size=page_size,
            head_num=self.num_key_value_heads,
            head_dim=self.head_dim,
            index_head_dim=self.index_head_dim,
            dtype=dtype,
            **overrides,
        )

    def check_layout(self, layout: SparseKVLayout) -> None:
        """Raises `ValueError` if `layout` does not describe this model's layers and heads."""
        expected = dict(
            dense_layer_ids=self.dense_layer_ids,
            sparse_layer_ids=self.sparse_layer_ids,
            k_only_layer_ids=self.k_only_layer_ids,
            head_num=self.num_key_value_heads,
            head_dim=self.head_dim,
            v_head_dim=self.head_dim,
            index_head_dim=self.index_head_dim,
        )
        wrong = {k: (v, getattr(layout, k)) for k, v in expected.items() if getattr(layout, k) != v}
        if wrong:
            detail = "; ".join(f"{k}: model {m}, layout {c}" for k, (m, c) in wrong.items())
            raise ValueError(f"cache layout does not match the model: {detail}")


def tiny_config(layer_types: str = "dssd", mlp_layer_types: str | None = None, **overrides: Any) -> MiniMaxM3Config:
    """A toy M3 for tests: one letter per layer, ``d`` dense / ``s`` sparse attention.

    MLPs default to dense for dense-attention layers and MoE elsewhere
    (``mlp_layer_types`` takes ``d``/``m`` letters to choose).
    """
    types = tuple(SPARSE if c == "s" else DENSE for c in layer_types)
    if mlp_layer_types is None:
        mlp = tuple("dense" if t == DENSE else "sparse" for t in types)
    else:
        mlp = tuple("dense" if c == "d" else "sparse" for c in mlp_layer_types)
    fields: dict[str, Any] = dict(
        num_hidden_layers=len(types),
        layer_types=types,
        mlp_layer_types=mlp,
        disable_index_value=(True,) * len(types),
    )
    fields.update(overrides)
    return MiniMaxM3Config(**fields)


def tiny_vision_config(**overrides: Any) -> VisionConfig:
    """A toy vision tower for tests: 2 layers, width 32, 2 heads (head_dim 16, RoPE on 12 channels)."""
    fields: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projector_hidden_size=48,
        image_token_id=250,
        image_start_token_id=251,
        image_end_token_id=252,
        video_token_id=253,
    )
    fields.update(overrides)
    return VisionConfig(**fields)


def demo_config() -> MiniMaxM3Config:
    """The demo's model: M3 at toy width (1 dense + 3 sparse attention layers, MoE in the sparse ones, 4 KV heads)."""
    return tiny_config(
        "dsss",
        "dmmm",
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
        rotary_dim=16,
        intermediate_size=64,
        dense_intermediate_size=256,
        shared_intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        index_n_heads=4,
        index_head_dim=32,
        index_block_size=16,
        index_topk_blocks=4,
        index_local_blocks=1,
    )
