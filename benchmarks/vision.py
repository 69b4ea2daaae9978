"""The vision tower's cost per image, and a 1-image request's time to first token with the encoder cache cold/warm.

python -m benchmarks.vision                   # demo-sized and the release's 32-layer, 1280-wide tower; writes
                                              # benchmarks/results/vision.json and vision.md
python -m benchmarks.vision --quick --out /tmp/bench   # demo-sized only, a smaller image (a smoke run)

1. Vision tower + projector on one image at the image processor's default max pixels (672 x 672 -> 48 x 48
   patches = 2,304 patches, 576 placeholder tokens), f32 on this machine's CPU: a demo-sized tower and the
   release's (32 layers x 1280, 16 heads; projector 1280 -> 6144 -> 6144, merge 24576 -> 6144 -> 6144; random
   weights, ~0.86 B parameters). The first call compiles; the median of the timed calls after it is reported.
2. An `Engine` on a demo-sized VL model: a 1-image request's time to first token (add_request -> the step
   that emits its first token) when the image is new (the vision tower runs) and when the same image comes
   again (its features come from the encoder cache). Prefix caching is off, so the warm request recomputes
   the whole prompt: the difference is the vision tower alone. Every program is compiled before timing
   (a request with another image of the same size runs first).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import standalone


def demo_vision_config(**overrides):
    from jax_sparse_kv.nn.config import VisionConfig

    fields = dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        projector_hidden_size=256,
        image_token_id=500,
        image_start_token_id=501,
        image_end_token_id=502,
    )
    fields.update(overrides)
    return VisionConfig(**fields)


def release_vision_config():
    from jax_sparse_kv.nn.config import VisionConfig

    return VisionConfig(image_start_token_id=200029, image_end_token_id=200030)  # transformers' defaults = release


def tower_seconds(vision, text_hidden: int, side: int, repeats: int) -> dict:
    """Seconds per image of vision tower + projector on a ``side x side`` image (first call: compile + run)."""
    from jax_sparse_kv.multimodal import ImageProcessor
    from jax_sparse_kv.nn.init import Init
    from jax_sparse_kv.nn.model import _encode_images
    from jax_sparse_kv.nn.vision import MultiModalProjector, VisionTower, patch_bucket, vision_inputs

    init = Init(0, jnp.float32)
    t = time.perf_counter()
    tower = VisionTower(vision, init=init)
    projector = MultiModalProjector(vision, text_hidden, init=init)
    built = time.perf_counter() - t
    params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state((tower, projector))))
    image = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    batch = ImageProcessor()(image)
    n = len(batch.pixel_values)
    padded = patch_bucket(n, vision.spatial_merge_size**2)
    positions, segments = vision_inputs(batch.grid_thw, vision.spatial_merge_size, pad_to=padded)
    pixels = jnp.pad(jnp.asarray(batch.pixel_values), ((0, padded - n), (0, 0)))
    t = time.perf_counter()
    jax.block_until_ready(_encode_images(tower, projector, pixels, positions, segments))
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(_encode_images(tower, projector, pixels, positions, segments))
        times.append(time.perf_counter() - t)
    return {
        "parameters": params,
        "image": f"{side}x{side}",
        "patches": n,
        "padded_patches": padded,
        "tokens": n // vision.spatial_merge_size**2,
        "build_s": built,
        "first_call_s": first,
        "median_s": statistics.median(times),
        "runs": len(times),
    }


def ttft(side: int, repeats: int) -> dict:
    """A 1-image request's time to first token with the image new (encoder cold) and seen before (warm)."""
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.serving import Engine, SamplingParams

    config = demo_config()
    model = MiniMaxM3(type(config)(**{**config.__dict__, "vision": demo_vision_config()}), seed=0)
    engine = Engine(model, num_pages=256, page_size=16, max_seqs=4, max_tokens_per_step=256, prefix_caching=False)
    rng = np.random.default_rng(1)
    prompt = [5, 6, 7, model.config.vision.image_token_id, 8, 9, 10]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def first_token(image) -> float:
        t = time.perf_counter()
        rid = engine.add_request(prompt, params, images=[image])
        while True:
            for out in engine.step():
                if out.request_id == rid and out.token_ids:
                    return time.perf_counter() - t

    def new_image():
        return rng.integers(0, 256, (side, side, 3), dtype=np.uint8)

    first_token(new_image())  # compiles the step programs and the vision tower's
    cold, warm = [], []
    for _ in range(repeats):
        image = new_image()
        cold.append(first_token(image))
        warm.append(first_token(image))
    stats = engine.stats()
    return {
        "image": f"{side}x{side}",
        "cold_median_s": statistics.median(cold),
        "warm_median_s": statistics.median(warm),
        "runs": repeats,
        "encoded_images": stats.encoded_images,
        "encoder_cache_hits": stats.encoder_cache_hits,
    }


def markdown(results: dict) -> str:
    lines = [
        "# Vision tower and image requests",
        "",
        f"Machine: {results['machine']}; JAX {results['jax']}; `{results['command']}`.",
        "",
        "## Vision tower + projector, one image (f32, CPU)",
        "",
        "| tower | parameters | image | patches (padded) | tokens | first call (compile + run) | per image |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results["tower"].items():
        lines.append(
            f"| {name} | {r['parameters'] / 1e6:.1f} M | {r['image']} | {r['patches']} "
            f"({r['padded_patches']}) | {r['tokens']} | {r['first_call_s']:.2f} s | "
            f"{r['median_s']:.3f} s (median of {r['runs']}) |"
        )
    t = results["ttft"]
    lines += [
        "",
        "## Time to first token of a 1-image request (demo-sized VL model, Engine)",
        "",
        "| image | encoder cache cold (vision tower runs) | warm (features cached) | cold / warm |",
        "|---|---|---|---|",
        f"| {t['image']} | {t['cold_median_s'] * 1e3:.1f} ms | {t['warm_median_s'] * 1e3:.1f} ms | "
        f"{t['cold_median_s'] / t['warm_median_s']:.2f}x |",
        "",
        f"Medians of {t['runs']} request pairs; the engine ran the vision tower {t['encoded_images']} times "
        f"and answered {t['encoder_cache_hits']} lookups from its encoder cache.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = standalone.parse_args(__doc__, argv, "demo-sized tower only, a 112 x 112 image")
    side = 112 if args.quick else 672
    results = {**standalone.header("vision", args.quick), "tower": {}}
    results["tower"]["demo (4 x 128)"] = tower_seconds(demo_vision_config(), 128, side, args.repeats)
    if not args.quick:
        results["tower"]["release (32 x 1280)"] = tower_seconds(release_vision_config(), 6144, side, args.repeats)
    results["ttft"] = ttft(side, args.repeats)
    standalone.save("vision", results, markdown(results), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
