"""Multimodal inputs of MiniMax-M3 VL: images in, what the vision tower and the prompt take out.

- `ImageProcessor` (`image_processor.py`): images (PIL or uint8 arrays) -> `ImageBatch` (``pixel_values
  [patches, 1176]`` float32, ``grid_thw [images, 3]``), equal to transformers' ``MiniMaxM3VLImageProcessor``
  without torch; `smart_resize` the size an image is processed at; `resize_bicubic_aa` its resize.
- `media.py`: what an HTTP client sends -> a PIL image (`decode_data_url`, `load_image`); needs Pillow (the
  ``images`` extra), imported on first use.
- `tokens.py`: image placeholders in prompts (`expand_image_tokens`, as transformers' processor expands them).
- `VideoProcessor` (`video_processor.py`): a video's frames -> `VideoBatch` (``pixel_values [t*h*w, 1176]``,
  ``grid_thw [rows, 3]``, rows of at most 4 temporal patches, timestamps), transformers'
  ``MiniMaxM3VLVideoProcessor`` without torch.
- `Processor` (`processor.py`): text + images + videos -> `ProcessorOutput` (expanded ``input_ids`` with the
  videos' timestamp text, ``images``, ``videos``), as transformers' ``MiniMaxM3VLProcessor``.
"""

from jax_sparse_kv.multimodal.image_processor import (
    CLIP_MEAN,
    CLIP_STD,
    ImageBatch,
    ImageProcessor,
    resize_bicubic_aa,
    smart_resize,
)
from jax_sparse_kv.multimodal.media import IMAGE_FORMATS, decode_data_url, load_image
from jax_sparse_kv.multimodal.processor import Processor, ProcessorOutput, timestamp_text
from jax_sparse_kv.multimodal.tokens import expand_image_tokens, image_token_counts, placeholder_spans
from jax_sparse_kv.multimodal.video_processor import VideoBatch, VideoProcessor, sample_frame_indices

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGE_FORMATS",
    "ImageBatch",
    "ImageProcessor",
    "decode_data_url",
    "expand_image_tokens",
    "image_token_counts",
    "load_image",
    "placeholder_spans",
    "Processor",
    "ProcessorOutput",
    "sample_frame_indices",
    "timestamp_text",
    "VideoBatch",
    "VideoProcessor",
    "resize_bicubic_aa",
    "smart_resize",
]
