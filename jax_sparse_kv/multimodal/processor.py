"""Text + images + videos -> the prompt ids and vision inputs, as transformers' ``MiniMaxM3VLProcessor`` makes them.

transformers replaces, in the *text*, each ``]<]image[>[`` by ``]<]start of image[>[`` + ``]<]image[>[`` *
``h * w // 4`` + ``]<]end of image[>[``, and each ``]<]video[>[`` by, for each temporal patch ``p`` of the video,
its timestamp ``]<]{ts:.1f} seconds[>[`` (only when the video's fps is known: ``ts = frames_indices[2 p] / fps``),
``]<]start of image[>[``, ``]<]video[>[`` * ``h * w // 4``, ``]<]end of image[>[``; then it tokenizes the text.

`Processor` writes the same text with one placeholder between each start/end pair, tokenizes it, and repeats each
placeholder id to its count: the same ids (placeholders and start/end are added tokens, which the tokenizer splits
out before anything else), without tokenizing hundreds of thousands of placeholders.

Where this differs from transformers: transformers' processor passes ``do_resize=False`` to its video processor (so
frames whose sides are not multiples of 28 fail in a reshape, and large frames are not downscaled); here videos go
through `VideoProcessor` with its own ``do_resize`` (True by default: frames resized by the image rule, which is
what transformers' video processor does on its own). The ids equal transformers' whenever both resize alike:
frames already at their `smart_resize` size, or transformers called with ``videos_kwargs={"do_resize": True}``.
Timestamps come from ``video_fps`` (transformers: ``video_metadata`` with ``fps`` and ``frames_indices``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_sparse_kv.multimodal.image_processor import ImageBatch, ImageProcessor
from jax_sparse_kv.multimodal.video_processor import VideoBatch, VideoProcessor

__all__ = [
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "VISION_START_TOKEN",
    "VISION_END_TOKEN",
    "Processor",
    "ProcessorOutput",
    "timestamp_text",
]

IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
VISION_START_TOKEN = "]<]start of image[>["
VISION_END_TOKEN = "]<]end of image[>["
_MARKERS = re.compile(re.escape(IMAGE_TOKEN) + "|" + re.escape(VIDEO_TOKEN))


def timestamp_text(seconds: float) -> str:
    """The text before a video's temporal patch: ``]<]{seconds:.1f} seconds[>[``."""
    return f"]<]{seconds:.1f} seconds[>["


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessorOutput:
    """What `Processor` gives: the prompt ids (a list of ints for one text, a list of them for a list of texts),
    one `ImageBatch` per image and one `VideoBatch` per video, in order across the texts."""

    input_ids: list[int] | list[list[int]]
    images: list[ImageBatch]
    videos: list[VideoBatch]

    @property
    def pixel_values(self) -> np.ndarray | None:
        """transformers' ``pixel_values``: ``[patches, patch_dim]`` of all images (None without images)."""
        return np.concatenate([b.pixel_values for b in self.images]) if self.images else None

    @property
    def image_grid_thw(self) -> np.ndarray | None:
        return np.concatenate([b.grid_thw for b in self.images]) if self.images else None

    @property
    def pixel_values_videos(self) -> np.ndarray | None:
        """transformers' ``pixel_values_videos``: ``[patches, patch_dim]`` of all videos (None without videos)."""
        return np.concatenate([b.pixel_values for b in self.videos]) if self.videos else None

    @property
    def video_grid_thw(self) -> np.ndarray | None:
        """transformers' ``video_grid_thw``: ``[rows, 3]``, every video's rows in order."""
        return np.concatenate([b.grid_thw for b in self.videos]) if self.videos else None


class Processor:
    """MiniMax-M3 VL's processor: a tokenizer, an `ImageProcessor` and a `VideoProcessor`.

    ``tokenizer``: a ``tokenizers.Tokenizer``, or an object holding one as ``.tokenizer`` (the server's
    ``TextTokenizer``); it must know the four vision tokens (``]<]image[>[``, ``]<]video[>[``, ``]<]start of
    image[>[``, ``]<]end of image[>[``) as added tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: ImageProcessor | None = None,
        video_processor: VideoProcessor | None = None,
    ):
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.image_processor = image_processor if image_processor is not None else ImageProcessor()
        self.video_processor = video_processor if video_processor is not None else VideoProcessor()
        self.image_token_id: int | None = self.tokenizer.token_to_id(IMAGE_TOKEN)
        self.video_token_id: int | None = self.tokenizer.token_to_id(VIDEO_TOKEN)
        self.vision_start_token_id: int | None = self.tokenizer.token_to_id(VISION_START_TOKEN)
        self.vision_end_token_id: int | None = self.tokenizer.token_to_id(VISION_END_TOKEN)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Processor:
        """The processor of a checkpoint directory: ``tokenizer.json``, the image and the video processor configs.

        Raises:
            FileNotFoundError: no directory, or no ``tokenizer.json`` in it.
        """
        from tokenizers import Tokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json: the processor needs it to tokenize the prompt")
        return cls(
            Tokenizer.from_file(str(path / "tokenizer.json")),
            ImageProcessor.from_pretrained(path),
            VideoProcessor.from_pretrained(path),
        )

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        video_fps: float | Sequence[float | None] | None = None,
        add_special_tokens: bool = True,
    ) -> ProcessorOutput:
        """Expand and tokenize ``text`` (one string or a list) with its ``images`` and ``videos``.

        Args:
            text: a prompt holding one ``]<]image[>[`` per image and one ``]<]video[>[`` per video, in order (a
                list of prompts: the images and videos follow each other across them).
            images: PIL images, uint8 arrays or one-image `ImageBatch`es.
            videos: each a ``[T, H, W, C]`` uint8 array, a list of frames, or a `VideoBatch`.
            video_fps: the source fps of each video (one number: all videos); None: no timestamps.
            add_special_tokens: the tokenizer's own (BOS, ...); False for a prompt a chat template rendered.

        Raises:
            ValueError: marker counts that differ from the inputs, a tokenizer without the vision tokens.
        """
        texts = [text] if isinstance(text, str) else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a string or a list of strings")
        images, videos = list(images or ()), list(videos or ())
        for name, marker, given in (("images", IMAGE_TOKEN, images), ("videos", VIDEO_TOKEN, videos)):
            found = sum(t.count(marker) for t in texts)
            if found != len(given):
                raise ValueError(f"the text holds {found} {marker} markers for {len(given)} {name}: one per input")
        if isinstance(video_fps, (int, float)) or video_fps is None:
            fps_list: list[float | None] = [video_fps] * len(videos)
        else:
            fps_list = list(video_fps)
            if len(fps_list) != len(videos):
                raise ValueError(f"video_fps has {len(fps_list)} entries for {len(videos)} videos")
        image_batches = [im if isinstance(im, ImageBatch) else self.image_processor(im) for im in images]
        bad = [i for i, b in enumerate(image_batches) if b.num_images != 1]
        if bad:
            raise ValueError(f"images[{bad[0]}] is an ImageBatch of {image_batches[bad[0]].num_images} images")
        video_batches = [
            v if isinstance(v, VideoBatch) else self.video_processor(v, fps=f)
            for v, f in zip(videos, fps_list, strict=True)
        ]
        needed = [("image", self.image_token_id)] * bool(images) + [("video", self.video_token_id)] * bool(videos)
        needed += [("start", self.vision_start_token_id), ("end", self.vision_end_token_id)] * bool(images or videos)
        missing = [name for name, value in needed if value is None]
        if missing:
            raise ValueError(f"the tokenizer does not know the vision tokens {missing}: it is not a VL tokenizer")
        out, image_iter, video_iter = [], iter(image_batches), iter(video_batches)
        for t in texts:
            out.append(self._expand(t, image_iter, video_iter, add_special_tokens))
        return ProcessorOutput(out[0] if isinstance(text, str) else out, image_batches, video_batches)

    def _expand(self, text: str, images: Any, videos: Any, add_special_tokens: bool = True) -> list[int]:
        counts: list[int] = []  # placeholders of each placeholder id the text will hold, in order
        pieces, last = [], 0
        for match in _MARKERS.finditer(text):
            pieces.append(text[last : match.start()])
            last = match.end()
            if match.group() == IMAGE_TOKEN:
                batch = next(images)
                pieces.append(VISION_START_TOKEN + IMAGE_TOKEN + VISION_END_TOKEN)
                counts.append(batch.num_tokens[0])
            else:
                video = next(videos)
                stamps = video.timestamps
                for p in range(video.num_temporal_patches):
                    pieces.append(
                        (timestamp_text(stamps[p]) if stamps is not None else "")
                        + VISION_START_TOKEN
                        + VIDEO_TOKEN
                        + VISION_END_TOKEN
                    )
                    counts.append(video.tokens_per_frame)
        pieces.append(text[last:])
        ids = self.tokenizer.encode("".join(pieces), add_special_tokens=add_special_tokens).ids
        placeholders = (self.image_token_id, self.video_token_id)
        found = sum(i in placeholders for i in ids)
        if found != len(counts):
            raise ValueError(
                f"the tokenized prompt holds {found} vision placeholders, {len(counts)} expected: "
                "the text itself holds a vision token"
            )
        out: list[int] = []
        runs = iter(counts)
        for i in ids:
            if i in placeholders:
                out.extend([i] * next(runs))
            else:
                out.append(i)
        return out
