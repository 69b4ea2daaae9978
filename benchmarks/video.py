"""Videos: vision tokens and vision-encoder time per second of video (issue 48).

python -m benchmarks.video                           # writes benchmarks/results/video.json, prints the table
python -m benchmarks.video --quick --out /tmp/bench  # two short videos (a smoke run)

Synthetic videos of 2, 4, 8 and 16 seconds (4 frames per second, 640 x 360, smooth moving gradients) go
through `jax_sparse_kv.multimodal.VideoProcessor` sampling 1 frame per second (``do_sample_frames``; transformers'
target ``fps`` 1), then through the vision tower + projector of a demo-sized VL model (the tower of
`benchmarks.vision`: 4 layers x 128, f32, random weights) the way the engine encodes a video: one program per
``video_grid_thw`` row (``vision_segment_max_frames``: at most 4 temporal patches a row), padded to the patch
bucket. Reported per video: sampled frames, temporal patches, vision tokens (the prompt's placeholders), the
processor's and the encoder's seconds (the median of ``--repeats`` runs after one warm-up run that compiles),
and per second of video: tokens and encoder time. Tokens per second of video depend only on the processor's
settings and the frame size, so they transfer to any hardware; the times are this machine's.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks import standalone

SECONDS = (2, 4, 8, 16)
SOURCE_FPS = 4
HEIGHT, WIDTH = 360, 640  # a 360p video


def synthetic_video(seconds: int, fps: int = SOURCE_FPS, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """``[seconds * fps, height, width, 3]`` uint8: gradients that move with the frame index."""
    y, x = np.mgrid[0:height, 0:width]
    frames = [
        np.stack([(x + 8 * i) % 256, (y + 4 * i) % 256, np.full_like(x, 16 * i % 256)], -1)
        for i in range(seconds * fps)
    ]
    return np.stack(frames).astype(np.uint8)


def demo_vl_model():
    """The demo model with `benchmarks.vision`'s demo-sized vision tower (random weights)."""
    from benchmarks.vision import demo_vision_config
    from jax_sparse_kv.nn import MiniMaxM3, demo_config

    config = demo_config()
    vision = demo_vision_config(video_token_id=503)
    return MiniMaxM3(type(config)(**{**config.__dict__, "vision": vision}), seed=0)


def encode(model, batch) -> int:
    """The engine's encoding of one video (`Engine._image_features`): one `embed_images` call per grid row.
    Returns the feature rows (vision tokens)."""
    rows = np.asarray(batch.grid_thw, np.int64).reshape(-1, 3)
    ends = np.cumsum(rows.prod(axis=1))
    parts = [
        np.asarray(model.embed_images(batch.pixel_values[end - row.prod() : end], row[None])[0])
        for row, end in zip(rows, ends, strict=True)
    ]
    return sum(len(p) for p in parts)


def measure(model, seconds: int, repeats: int) -> dict:
    """One video of `seconds`: processor and encoder medians of `repeats` runs after a warm-up."""
    from jax_sparse_kv.multimodal import VideoProcessor

    processor = VideoProcessor(do_sample_frames=True, fps=1.0)
    frames = synthetic_video(seconds)
    batch = processor(frames, fps=float(SOURCE_FPS))
    assert encode(model, batch) == batch.num_tokens  # warm-up: compiles this video's patch buckets
    process_s, encode_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        batch = processor(frames, fps=float(SOURCE_FPS))
        process_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        encode(model, batch)
        encode_s.append(time.perf_counter() - t)
    process, enc = statistics.median(process_s), statistics.median(encode_s)
    return {
        "seconds": seconds,
        "source_frames": len(frames),
        "sampled_frames": len(batch.frames_indices),
        "processed_frame_hw": (batch.grid_thw[0, 1:] * processor.patch_size).tolist(),
        "temporal_patches": batch.num_temporal_patches,
        "grid_thw": batch.grid_thw.tolist(),
        "vision_tokens": batch.num_tokens,
        "tokens_per_video_second": batch.num_tokens / seconds,
        "processor_median_s": process,
        "encoder_median_s": enc,
        "encoder_s_per_video_second": enc / seconds,
        "runs": repeats,
    }


def markdown(results: dict) -> str:
    lines = [
        f"Machine: {results['machine']}; JAX {results['jax']}; `{results['command']}`; {results['setup']}.",
        "",
        "| video | sampled frames | temporal patches | vision tokens | tokens / s of video | processor | "
        "encoder | encoder / s of video |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["videos"]:
        lines.append(
            f"| {r['seconds']} s | {r['sampled_frames']} | {r['temporal_patches']} | {r['vision_tokens']} "
            f"| {r['tokens_per_video_second']:.0f} | {r['processor_median_s'] * 1e3:.1f} ms | "
            f"{r['encoder_median_s'] * 1e3:.1f} ms | "
            f"{r['encoder_s_per_video_second'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import json

    args = standalone.parse_args(__doc__, argv, "2 and 4 second videos only")
    model = demo_vl_model()
    lengths = SECONDS[:2] if args.quick else SECONDS
    results = {
        **standalone.header("video", args.quick),
        "setup": f"{WIDTH} x {HEIGHT} frames at {SOURCE_FPS} fps, sampled at 1 fps; demo-sized tower "
        "(4 x 128), f32; medians of the runs after one warm-up",
        "videos": [measure(model, s, args.repeats) for s in lengths],
    }
    path = standalone.results_path("video", args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
