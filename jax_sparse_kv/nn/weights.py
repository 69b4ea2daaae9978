"""Hugging Face checkpoints of MiniMax-M3: the weight-name map, loading and saving.

The model's parameters carry transformers' names and layouts
(``model.layers.{l}.self_attn.q_proj.weight [out, in]``,
``model.layers.{l}.mlp.experts.gate_up_proj [E, 2I, H]``, ...). A checkpoint
may also use the original release's names; `checkpoint_pieces` maps each of
its keys to the part of a transformers-named tensor it fills (the inverse of
transformers' ``conversion_mapping`` for ``minimax_m3_vl``). That map is the
one place where checkpoint names are known.

Loading reads one tensor at a time with `safetensors` (host memory peaks near
the largest tensor, not the model) and, with a mesh, puts each straight into
its shards. Every key and shape is checked before any tensor is read. With a
mesh, a process reads from the files only the parts of each tensor that its
own devices hold (`safetensors` slices): with ``jax.distributed`` over several
hosts, each host reads its shards and the replicated tensors, not the whole
checkpoint (block-fp8 tensors, dequantized as they are read, are read whole).

Block-fp8 checkpoints (``quantization_config.quant_method = "fp8"``, the format
of DeepSeek-V3 and MiniMax-M2 releases): a ``K.weight`` stored as float8 comes
with ``K.weight_scale_inv`` of shape ``[ceil(out / b0), ceil(in / b1)]`` for
``weight_block_size = [b0, b1]``; the real weight is the fp8 value times its
block's ``weight_scale_inv`` (float32). MXFP8 checkpoints (``quant_method =
"mxfp8"``, the MiniMax-M3-MXFP8 release, the OCP Microscaling format): a
float8_e4m3fn ``K.weight [out, in]`` with ``K.weight_scale_inv [out, in / 32]``
of **uint8** E8M0 exponents, factor ``2 ** (v - 127)`` (255 is NaN), one per 32
inputs; ``ignored_layers`` are stored unquantized. Every scale's dtype and
shape is checked against its format before any tensor is read. The loader
dequantizes each such tensor as it reads it (vectorized, one tensor at a time,
into the model dtype, bf16 by default), so the model is the same whichever way
the checkpoint stores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv.nn.config import MiniMaxM3Config
from jax_sparse_kv.nn.parallel import model_partition_specs, set_expert_parallel
from jax_sparse_kv.nn.params import SCALE_SUFFIX, hf_params, named_params, quantizable_params, quantize_param
from jax_sparse_kv.nn.quant import BlockQuant, dequantize_block_fp8, e8m0_to_float32

# The model class comes in as `model_cls` (as transformers' from_pretrained takes `cls`) and models are plain
# `nnx.Module`s here: this module never imports the model (nn imports one way: model -> weights -> parallel ->
# params). `MiniMaxM3` below, in docstrings, is what they are.

__all__ = [
    "checkpoint_pieces",
    "load_pretrained",
    "save_pretrained",
    "Piece",
    "QuantFormat",
    "dequantize_block_fp8",
    "e8m0_to_float32",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Block size of ``quant_method: fp8`` when the config does not give ``weight_block_size``.
DEFAULT_FP8_BLOCK = (128, 128)
#: Block of ``quant_method: mxfp8`` (OCP MX): one E8M0 scale per 32 consecutive inputs of a row.
MXFP8_BLOCK = (1, 32)
#: The tokens that bracket an image in MiniMax-M3 VL prompts (transformers' `MiniMaxM3VLProcessor`).
IMAGE_START_TOKEN = "]<]start of image[>["
IMAGE_END_TOKEN = "]<]end of image[>["

# Keys no model reads: the MTP head.
_IGNORED = re.compile(r"^(mtp\.|model\.mtp\.|language_model\.mtp\.)")
# The vision tower and projector of a VL checkpoint (both spellings): read when the model has a vision tower.
_VISION = re.compile(
    r"^(vision_tower\.|model\.vision_tower\.|multi_modal_projector\.|model\.multi_modal_projector\."
    r"|patch_merge_mlp\.)"
)
# The release's vision names -> transformers' (its conversion_mapping for minimax_m3_vl, as renames).
_VISION_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^vision_tower\.vision_model\.embeddings\.patch_embedding\.", "model.vision_tower.embeddings.proj."),
    (r"^vision_tower\.vision_model\.encoder\.layers\.", "model.vision_tower.layers."),
    (r"^vision_tower\.vision_model\.pre_layrnorm\.", "model.vision_tower.pre_layrnorm."),
    (r"^multi_modal_projector\.linear_(1|2)\.", r"model.multi_modal_projector.linear_\1."),
    (r"^patch_merge_mlp\.linear_(1|2)\.", r"model.multi_modal_projector.merge_linear_\1."),
)

# Original release name -> transformers name (applied in order, like conversion_mapping's renames).
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^language_model\.model\.", "model."),
    (r"^model\.language_model\.", "model."),  # transformers' VL model prefix
    (r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.block_sparse_moe\.(experts|gate|shared_experts)\.", r".mlp.\1."),
    (r"\.self_attn\.index_(q|k|v|o)_proj\.", r".self_attn.indexer.\1_proj."),
    (r"\.self_attn\.index_(q|k)_norm\.", r".self_attn.indexer.\1_norm."),
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_GATE_UP = re.compile(r"^(?P<prefix>.*)\.(?P<w>gate_proj|up_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where one checkpoint tensor goes: ``target[index] = tensor``.

    ``index`` is a tuple of ints/slices into the transformers-named target
    (``()`` = the whole tensor); ``what`` says which part in words, for errors.
    """

    target: str
    index: tuple[Any, ...] = ()
    what: str = ""


def checkpoint_pieces(key: str, config: MiniMaxM3Config) -> Piece | None:
    """The `Piece` a checkpoint key fills, or None for keys the model ignores (``mtp.*``; vision without a tower)."""
    if _IGNORED.match(key):
        return None
    if _VISION.match(key):
        if config.vision is None:
            return None
        name = key
        for pattern, repl in _VISION_RENAMES:
            name = re.sub(pattern, repl, name)
        return Piece(name)
    if config.tie_word_embeddings and key in ("lm_head.weight", "language_model.lm_head.weight"):
        return None  # tied: the LM head is the embedding
    name = key
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    if m := _EXPERT.match(name):
        e, w = int(m["e"]), m["w"]
        i = config.intermediate_size
        if w == "w2":
            return Piece(f"{m['prefix']}.down_proj", (e,), f"expert {e} w2")
        part = slice(0, i) if w == "w1" else slice(i, 2 * i)  # gate (w1) first, then up (w3)
        return Piece(f"{m['prefix']}.gate_up_proj", (e, part), f"expert {e} {w}")
    if m := _GATE_UP.match(name):
        inter = _mlp_width(m["prefix"], config)
        part = slice(0, inter) if m["w"] == "gate_proj" else slice(inter, 2 * inter)
        return Piece(f"{m['prefix']}.gate_up_proj.weight", (part,), m["w"])
    return Piece(name)


def _mlp_width(prefix: str, config: MiniMaxM3Config) -> int:
    if prefix.endswith(".shared_experts"):
        return config.shared_intermediate_size
    return config.dense_intermediate_size


def _target_shape(shape: tuple[int, ...], index: tuple[Any, ...]) -> tuple[int, ...]:
    return np.empty(shape, dtype=np.bool_)[index].shape if index else shape


# ---------------------------------------------------------------------- loading


def _headers(path: str) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """key -> (shape, dtype name, file) from the safetensors headers only (no tensor is read).

    Reads ``model.safetensors``, or every file of ``model.safetensors.index.json``
    (each key must be in the file the index names), opening each file once.
    """
    from safetensors import safe_open

    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = dict(json.load(f)["weight_map"])
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        weight_map = None
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    out = {}
    for file in sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]:
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            for key in f.keys():
                if weight_map is None or weight_map.get(key) == file:
                    s = f.get_slice(key)
                    out[key] = (tuple(s.get_shape()), s.get_dtype(), file)
    missing = sorted(set(weight_map or ()) - set(out))
    if missing:
        raise ValueError(f"{INDEX_FILE} lists tensors that are not in their files: {missing[:5]}")
    return out


_DTYPES = {"BF16": jnp.bfloat16, "F16": jnp.float16, "F32": jnp.float32, "F64": jnp.float64}
_FP8 = {"F8_E4M3": np.dtype(jnp.float8_e4m3fn), "F8_E5M2": np.dtype(jnp.float8_e5m2)}


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint's float8 weights are scaled: ``quant_method``, block ``[b0, b1]``, the scales' dtype."""

    method: str  # "fp8" (block fp8, float32 factors) or "mxfp8" (OCP MX, uint8 E8M0 exponents)
    block: tuple[int, int]
    scale_dtype: str  # safetensors dtype of every K.weight_scale_inv
    weight_dtypes: tuple[str, ...]  # safetensors dtypes its quantized weights may have

    @property
    def block_quant(self) -> BlockQuant:
        """The format as the model holds it (`jax_sparse_kv.nn.quant.BlockQuant`)."""
        return BlockQuant(self.method, self.block)


def _quant_format(path: str) -> QuantFormat | None:
    """The checkpoint's `QuantFormat`, None without quantization.

    Raises `ValueError` for any other quantization method (its tensors would
    otherwise be read as if they were the weights) and for a block size the
    format does not have.
    """
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    quant = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in ("fp8", "mxfp8"):
        raise ValueError(
            f"config.json: quantization_config.quant_method={method!r} is not supported; this loader reads "
            "unquantized checkpoints, block-fp8 ones (quant_method 'fp8', float32 weight_scale_inv) and MXFP8 ones "
            "(quant_method 'mxfp8', uint8 E8M0 weight_scale_inv per 32 inputs)"
        )
    default = DEFAULT_FP8_BLOCK if method == "fp8" else MXFP8_BLOCK
    block = tuple(quant.get("weight_block_size") or default)
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"config.json: quantization_config.weight_block_size must be two positive ints, got {block}")
    if method == "mxfp8":
        if block != MXFP8_BLOCK:
            raise ValueError(
                f"config.json: quant_method 'mxfp8' has weight_block_size {list(MXFP8_BLOCK)} (one E8M0 scale per "
                f"32 inputs), got {list(block)}"
            )
        return QuantFormat("mxfp8", block, "U8", ("F8_E4M3",))
    return QuantFormat("fp8", block, "F32", tuple(_FP8))


def _split_scales(
    headers: Mapping[str, tuple[tuple[int, ...], str, str]], quant: QuantFormat | None
) -> tuple[dict[str, tuple[tuple[int, ...], str, str]], dict[str, str]]:
    """``(weight headers, fp8 weight key -> its scale key)``, every pairing, dtype and shape checked.

    Raises `ValueError` naming the key for an fp8 tensor without its scale (or
    without a quantization config), a scale without its weight, a weight or
    scale whose dtype is not its format's, and a scale whose shape does not
    match the weight's blocks.
    """
    scales = {k[: -len(SCALE_SUFFIX)]: k for k in headers if k.endswith(SCALE_SUFFIX)}
    weights = {k: v for k, v in headers.items() if not k.endswith(SCALE_SUFFIX)}
    problems = []
    for weight, scale in sorted(scales.items()):
        if weight not in weights:
            problems.append(f"{scale} has no {weight}")
        elif weights[weight][1] not in _FP8:
            problems.append(f"{scale} belongs to {weight}, which is {weights[weight][1]}, not float8")
    for key, (shape, dtype, _) in sorted(weights.items()):
        if dtype not in _FP8:
            continue
        if quant is None:
            problems.append(f"{key} is {dtype} but config.json has no quantization_config (quant_method 'fp8')")
        elif dtype not in quant.weight_dtypes:
            problems.append(f"{key} is {dtype}; quant_method {quant.method!r} weights are {quant.weight_dtypes[0]}")
        elif key not in scales:
            problems.append(f"{key} is {dtype} without {key}{SCALE_SUFFIX}")
        elif len(shape) < 2:
            problems.append(f"{key}: {quant.method} weights must be at least 2-D, got shape {shape}")
        else:
            scale_shape, scale_dtype, _ = headers[scales[key]]
            want = BlockQuant(quant.method, quant.block).scale_shape(tuple(shape))
            if scale_dtype != quant.scale_dtype:
                kind = "uint8 E8M0 exponents" if quant.scale_dtype == "U8" else "float32 factors"
                problems.append(
                    f"{scales[key]} is {scale_dtype}; quant_method {quant.method!r} scales are {quant.scale_dtype} "
                    f"({kind})"
                )
            elif tuple(scale_shape) != want:
                problems.append(
                    f"{scales[key]}: shape {tuple(scale_shape)}, expected {want} for {key} {shape} in blocks of "
                    f"{quant.block}"
                )
    if problems:
        kind = "quantized" if quant is None else f"{quant.method} ({'block-fp8' if quant.method == 'fp8' else 'MX'})"
        raise ValueError(f"{kind} checkpoint: " + "; ".join(problems))
    return weights, {k: v for k, v in scales.items() if k in weights}


def _read_raw(file: str, key: str, dtype: np.dtype) -> np.ndarray:
    """One tensor straight from a safetensors file as `dtype` (for float8, which NumPy's loader cannot read).

    The format: an 8-byte little-endian header length, a JSON header giving
    each tensor's shape and byte range, then the bytes.
    """
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[key]
        begin, end = entry["data_offsets"]
        f.seek(8 + n + begin)
        data = np.frombuffer(f.read(end - begin), dtype=np.uint8)
    return data.view(dtype).reshape(entry["shape"])


def _checkpoint_dtype(config: MiniMaxM3Config, headers: Mapping[str, tuple[tuple[int, ...], str, str]]) -> Any:
    """The float dtype holding most of the checkpoint's bytes (bf16 weights with an f32 bias: bf16)."""
    nbytes: dict[str, int] = {}
    for key, (shape, dtype, _) in headers.items():
        if dtype in _DTYPES and checkpoint_pieces(key, config) is not None:
            nbytes[dtype] = nbytes.get(dtype, 0) + int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize
    return _DTYPES[max(nbytes, key=nbytes.get)] if nbytes else jnp.float32


def plan_load(
    config: MiniMaxM3Config, params: Mapping[str, nnx.Variable], headers: Mapping[str, tuple[tuple[int, ...], str, str]]
) -> dict[str, list[tuple[str, Piece]]]:
    """target name -> [(checkpoint key, piece)], after checking names and shapes.

    Raises:
      ValueError: naming the key and both shapes for a mis-shaped tensor, the
        keys for unexpected tensors, and the targets (and parts) that nothing fills.
    """
    plan: dict[str, list[tuple[str, Piece]]] = {}
    unexpected, wrong = [], []
    for key, (shape, _, _) in sorted(headers.items()):
        piece = checkpoint_pieces(key, config)
        if piece is None:
            continue
        if piece.target not in params:
            unexpected.append(key)
            continue
        want = _target_shape(tuple(params[piece.target].shape), piece.index)
        if tuple(shape) != want:
            wrong.append(f"{key}: checkpoint shape {tuple(shape)}, model expects {want}")
            continue
        plan.setdefault(piece.target, []).append((key, piece))
    problems = []
    if wrong:
        problems.append("mis-shaped tensors: " + "; ".join(wrong))
    if unexpected:
        problems.append(f"unexpected tensors (not part of this model): {unexpected[:10]}")
    missing = []
    for name, var in params.items():
        pieces = plan.get(name, [])
        covered = np.zeros(tuple(var.shape), np.bool_)
        for _, piece in pieces:
            covered[piece.index] = True
        if not covered.all():
            parts = "" if not pieces else f" (only {sorted(p.what or k for k, p in pieces)[:6]} present)"
            missing.append(f"{name}{parts}")
    if missing:
        problems.append(f"missing tensors: {missing[:10]}")
    if problems:
        raise ValueError("checkpoint does not match the model: " + " | ".join(problems))
    return plan


def load_pretrained(
    path: str | os.PathLike,
    dtype: Any = None,
    mesh: Any = None,
    *,
    model_cls: type[nnx.Module],
    weight_dtype: Any = "auto",
    progress: bool = False,
    on_tensor: Callable[[str, np.ndarray], None] | None = None,
    config_overrides: Mapping[str, Any] | str | None = None,
) -> nnx.Module:
    """`MiniMaxM3.from_pretrained`: ``config.json`` + ``model.safetensors`` (or a sharded index).

    Args:
      model_cls: the class to build (`MiniMaxM3`, which passes itself, as transformers' ``from_pretrained`` is
        a classmethod over ``cls``): this module never imports the model, so `jax_sparse_kv.nn` imports one way.
      path: the checkpoint directory.
      dtype: parameter dtype; None keeps the checkpoint's (bf16 stays bf16).
      mesh: place each tensor straight into its shards (`jax_sparse_kv.nn.parallel`).
      weight_dtype: for a quantized checkpoint (block fp8, MXFP8): ``"auto"`` keeps its quantized
        projection and expert weights quantized in device memory (fp8 values + their scales, dequantized
        inside the matmul: `jax_sparse_kv.nn.quant`); a float dtype dequantizes them into it while loading.
        A quantized tensor whose pieces do not fall on its blocks' edges (a fused gate/up whose halves split
        a block) is dequantized into `dtype` either way.
      progress: show a progress bar over the tensors.
      on_tensor: called with each tensor read (tests use it to watch host memory).
      config_overrides: merged into config.json before it is read, as vLLM's ``--hf-overrides``
        (a dict or its JSON text; `jax_sparse_kv.hf_config.apply_hf_overrides`), e.g. YaRN to 1M
        positions: ``{"text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
        "original_max_position_embeddings": 524288}}}``.

    Raises:
      FileNotFoundError: no config.json or weights.
      ValueError: missing, unexpected or mis-shaped tensors, before any tensor is read.
    """
    path = os.fspath(path)
    if not (isinstance(weight_dtype, str) and weight_dtype == "auto"):
        weight_dtype = _float_dtype(weight_dtype)
    config = MiniMaxM3Config.from_pretrained(path, config_overrides)
    quant = _quant_format(path)
    every_tensor = _headers(path)
    if config.vision is not None and not any(_VISION.match(k) for k in every_tensor):
        config = config.text_only()  # a VL config.json over text-only weights: the text model
    config = _with_image_token_ids(config, path)
    headers, scale_of = _split_scales(every_tensor, quant)  # weights only; fp8 ones paired with their scales
    if dtype is None:
        dtype = _checkpoint_dtype(config, headers)
    model = model_cls(config, seed=None, dtype=dtype)  # shapes only: weights come from the file
    plan = plan_load(config, hf_params(model), headers)
    quantized = {name for name, pieces in plan.items() if all(key in scale_of for key, _ in pieces)}
    resident = set()
    if quant is not None and weight_dtype == "auto":
        resident = _resident_targets(model, plan, quantized, quant.block)
        for name in sorted(resident):
            quantize_param(model, name, quant.block_quant, dtype=_FP8[headers[plan[name][0][0]][1]])
        plan.update(_scale_plan(hf_params(model), plan, resident, scale_of, every_tensor, quant.block))
    elif weight_dtype != "auto":
        named = named_params(model)
        for name in quantized:
            module, attr, var = named[name]
            setattr(module, attr, nnx.Param(jax.ShapeDtypeStruct(tuple(var.shape), weight_dtype)))
    params = hf_params(model)
    raw = {key for name in resident for key, _ in plan[name] + plan[name + SCALE_SUFFIX]}  # read, not dequantized
    shardings = _shardings(model, mesh) if mesh is not None else {}

    from safetensors import safe_open

    with _progress(len(plan), progress) as bar, contextlib.ExitStack() as files:
        opened: dict[str, Any] = {}

        def read(key: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
            """Tensor `key`, or only its part `region` (slices; read from the file alone)."""
            _, dtype, file = every_tensor[key]
            if key in scale_of and key not in raw:  # block fp8 / MXFP8: dequantized as it is read (whole)
                scale = read(scale_of[key])
                if quant.method == "mxfp8":
                    scale = e8m0_to_float32(scale)
                tensor = _read_raw(os.path.join(path, file), key, _FP8[dtype])
                tensor = dequantize_block_fp8(tensor, scale, quant.block)
                tensor = tensor if region is None else tensor[region]
            elif dtype in _FP8:  # kept quantized: the fp8 values as stored
                tensor = _read_raw(os.path.join(path, file), key, _FP8[dtype])
                tensor = tensor if region is None else tensor[region]
            else:
                if file not in opened:
                    opened[file] = files.enter_context(safe_open(os.path.join(path, file), framework="numpy"))
                if region is None or not region:
                    tensor = opened[file].get_tensor(key)
                else:
                    tensor = opened[file].get_slice(key)[region]
            if on_tensor is not None:
                on_tensor(key, tensor)
            return tensor

        def assemble(name: str, pieces: list[tuple[str, Piece]], region: tuple[slice, ...] | None) -> np.ndarray:
            """The target tensor `name` (or its block `region`) from its checkpoint pieces."""
            var = params[name]
            shape = tuple(var.shape)
            target_dtype = np.dtype(var.dtype)
            whole = region is None or all(r.indices(n)[:2] == (0, n) for r, n in zip(region, shape, strict=True))
            if len(pieces) == 1 and pieces[0][1].index == ():
                return read(pieces[0][0], None if whole else region).astype(target_dtype, copy=False)
            region = tuple(slice(0, n) for n in shape) if region is None else region
            host = np.empty(_target_shape(shape, region), target_dtype)
            for key, piece in pieces:  # merged from parts (experts, gate/up): only the parts in `region`
                overlap = _overlap(region, piece.index, shape)
                if overlap is not None:
                    src, dst = overlap
                    host[dst] = read(key, src)
            return host

        for name, pieces in plan.items():
            var = params[name]
            sharding = shardings.get(name)
            if sharding is None:
                var.set_value(jnp.asarray(assemble(name, pieces, None)))
            else:
                var.set_value(_from_regions(tuple(var.shape), sharding, functools.partial(assemble, name, pieces)))
            bar.update(1)
    if mesh is not None:
        set_expert_parallel(model, mesh)
    return model


def _scale_index(index: tuple[Any, ...], block: tuple[int, int]) -> tuple[Any, ...] | None:
    """A piece's index into a weight (expert ids, row slices) as an index into its scale's blocks; None when a
    slice does not fall on block edges. (The name map only ever slices rows: gate/up halves.)"""
    out = []
    for p in index:
        if isinstance(p, slice):
            if p.start % block[0] or p.stop % block[0]:
                return None
            p = slice(p.start // block[0], p.stop // block[0])
        out.append(p)
    return tuple(out)


def _float_dtype(value: Any) -> np.dtype:
    """`value` as a float dtype of 16 bits or more (what weights dequantize into); `ValueError` otherwise."""
    try:
        dtype = jnp.dtype(value) if value is not None else None
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise ValueError(f"weight_dtype must be 'auto' or a float dtype (bfloat16, float16, float32), got {value!r}")
    return dtype


def _resident_targets(
    model: nnx.Module, plan: Mapping[str, list[tuple[str, Piece]]], quantized: set[str], block: tuple[int, int]
) -> set[str]:
    """The targets kept quantized: quantizable, filled by quantized pieces only (`quantized`), each on block
    edges; an expert module's two stacks both or neither (they share one format)."""
    keep = {
        name
        for name in quantizable_params(model)
        if name in quantized and all(_scale_index(piece.index, block) is not None for _, piece in plan[name])
    }
    for name in list(keep):
        if m := re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", name):
            other = f"{m[1]}.{'down_proj' if m[2] == 'gate_up_proj' else 'gate_up_proj'}"
            if other not in keep:
                keep.discard(name)
    return keep


def _scale_plan(params, plan, resident, scale_of, every_tensor, block) -> dict[str, list[tuple[str, Piece]]]:
    """target scale name -> [(scale key, piece)] for the resident targets, shapes checked."""
    out = {}
    for name in resident:
        target = name + SCALE_SUFFIX
        entries = []
        for key, piece in plan[name]:
            index = _scale_index(piece.index, block)
            want = _target_shape(tuple(params[target].shape), index)
            got = tuple(every_tensor[scale_of[key]][0])
            if got != want:
                raise ValueError(f"{scale_of[key]}: shape {got}, the model's {target} expects {want}")
            entries.append((scale_of[key], Piece(target, index, f"{piece.what or key} scale")))
        out[target] = entries
    return out


def _modules(model: nnx.Module) -> list[nnx.Module]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]


def _with_image_token_ids(config: MiniMaxM3Config, path: str) -> MiniMaxM3Config:
    """Fills the image start/end ids config.json does not name from the checkpoint's tokenizer."""
    v = config.vision
    if v is None or (v.image_start_token_id is not None and v.image_end_token_id is not None):
        return config
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return config
    with open(file) as f:
        added = {t.get("content"): t.get("id") for t in json.load(f).get("added_tokens", [])}
    start = v.image_start_token_id if v.image_start_token_id is not None else added.get(IMAGE_START_TOKEN)
    end = v.image_end_token_id if v.image_end_token_id is not None else added.get(IMAGE_END_TOKEN)
    vision = dataclasses.replace(v, image_start_token_id=start, image_end_token_id=end)
    return dataclasses.replace(config, vision=vision)


def _overlap(
    region: tuple[slice, ...], index: tuple[Any, ...], shape: tuple[int, ...]
) -> tuple[tuple[slice, ...], tuple[Any, ...]] | None:
    """Where a piece (``target[index] = tensor``) meets a block ``target[region]``.

    Returns ``(src, dst)``: ``block[dst] = tensor[src]``; None if they do not meet.
    """
    src, dst = [], []
    for d, (r, n) in enumerate(zip(region, shape, strict=True)):
        a, b, _ = r.indices(n)
        p = index[d] if d < len(index) else slice(None)
        if isinstance(p, (int, np.integer)):  # the piece is one entry of this dimension (which it drops)
            if not a <= p < b:
                return None
            dst.append(int(p) - a)
        else:
            start, stop, _ = p.indices(n)
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                return None
            src.append(slice(lo - start, hi - start))
            dst.append(slice(lo - a, hi - a))
    return tuple(src), tuple(dst)


def _from_regions(shape: tuple[int, ...], sharding: Any, block: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """A global array of `sharding` whose local shards are ``block(region)``, each region read once.

    Only this process's devices are asked for (`jax.make_array_from_callback`):
    on several hosts each reads its own shards.
    """
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        key = tuple((r.start, r.stop) for r in region)
        if key not in blocks:
            blocks[key] = block(region)
        return blocks[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def _shardings(model: nnx.Module, mesh: Any) -> dict[str, Any]:
    from jax.sharding import NamedSharding

    return {name: NamedSharding(mesh, spec) for name, spec in model_partition_specs(model, mesh).items()}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="loading", unit="tensor", disable=not enabled)


# ---------------------------------------------------------------------- saving


def _original_names(
    name: str, value: np.ndarray, config: MiniMaxM3Config, row_block: int = 1
) -> Iterable[tuple[str, np.ndarray]]:
    """A transformers-named tensor as the original release stores it (experts split, gate/up split).

    A block scale (``<name>_scale_inv``, rows in blocks of `row_block`) goes with its weight's pieces.
    """
    if name.endswith(SCALE_SUFFIX):
        for key, part in _original_names(name[: -len(SCALE_SUFFIX)], value, config, row_block):
            yield key + SCALE_SUFFIX, part
        return
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        for ours, theirs in _ORIGINAL_VISION:
            if name.startswith(ours):
                yield theirs + name[len(ours) :], value
                return
    prefix = "language_model."
    if m := re.match(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$", name):
        base = m[1].replace(".mlp", ".block_sparse_moe") + ".experts"
        for e in range(value.shape[0]):
            if m[2] == "down_proj":
                yield f"{prefix}{base}.{e}.w2.weight", value[e]
            else:
                i = config.intermediate_size // row_block
                yield f"{prefix}{base}.{e}.w1.weight", value[e, :i]
                yield f"{prefix}{base}.{e}.w3.weight", value[e, i:]
        return
    if m := re.match(r"^(.*)\.gate_up_proj\.weight$", name):
        half = value.shape[0] // 2
        base = m[1].replace(".mlp.shared_experts", ".block_sparse_moe.shared_experts")
        yield f"{prefix}{base}.gate_proj.weight", value[:half]
        yield f"{prefix}{base}.up_proj.weight", value[half:]
        return
    name = name.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
    name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    name = re.sub(r"\.self_attn\.indexer\.(q|k|v|o)_proj\.", r".self_attn.index_\1_proj.", name)
    name = re.sub(r"\.self_attn\.indexer\.(q|k)_norm\.", r".self_attn.index_\1_norm.", name)
    yield prefix + name, value


_VL_TEXT_PREFIX = "model.language_model."
_ORIGINAL_VISION = (  # the inverse of _VISION_RENAMES
    ("model.vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
    ("model.vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
    ("model.vision_tower.pre_layrnorm.", "vision_tower.vision_model.pre_layrnorm."),
    ("model.multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
    ("model.multi_modal_projector.linear_", "multi_modal_projector.linear_"),
)


def save_pretrained(
    model: nnx.Module,
    path: str | os.PathLike,
    *,
    spelling: str = "transformers",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes ``config.json`` and safetensors weights that `load_pretrained` (and transformers) read.

    Args:
      spelling: ``"transformers"`` (flat config, transformers' key names) or
        ``"original"`` (checkpoint config spelling, ``language_model.*`` keys,
        experts and gate/up split as in the original release).
      max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` files
        with a ``model.safetensors.index.json`` when given.
    """
    from safetensors.numpy import save_file

    if spelling not in ("transformers", "original"):
        raise ValueError(f"spelling must be 'transformers' or 'original', got {spelling!r}")
    if tuple(model.layer_ids) != model.config.layer_ids:
        raise ValueError("save_pretrained needs a whole model, not a pipeline stage")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = model.config
    with open(os.path.join(path, "config.json"), "w") as f:
        if spelling == "original":
            cfg = config.to_checkpoint_dict()
        else:
            cfg = config.to_hf() if config.vision is None else config.to_hf_vl()
        quants = {m.quant for m in _modules(model) if getattr(m, "quant", None) is not None}
        if len(quants) > 1:
            raise ValueError(f"the model's weights are quantized in more than one format: {sorted(map(str, quants))}")
        if quants:
            (quant,) = quants
            cfg["quantization_config"] = {"quant_method": quant.method, "weight_block_size": list(quant.block)}
        json.dump(cfg, f, indent=2)
    tensors: dict[str, np.ndarray] = {}
    for name, var in hf_params(model).items():
        value = np.asarray(jax.device_get(var[...]))
        if spelling == "original":
            row_block = quants and next(iter(quants)).block[0] if name.endswith(SCALE_SUFFIX) else 1
            tensors.update((k, np.ascontiguousarray(v)) for k, v in _original_names(name, value, config, row_block))
        elif config.vision is not None:  # transformers' VL model: the text model under model.language_model
            tensors[re.sub(r"^model\.(?!vision_tower\.|multi_modal_projector\.)", _VL_TEXT_PREFIX, name)] = value
        else:
            tensors[name] = value
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "np"})
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "np"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(v.nbytes for v in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
