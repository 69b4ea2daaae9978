"""Videos in chat requests: which content parts are videos, and their decoding with PyAV (the ``video`` extra).

A chat message's ``content`` may hold video parts::

    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}
    {"type": "video_url", "video_url": {"url": "https://media.example.com/clip.mp4"}}

`video_sources` finds them in order (with the request path each came from); `video_bytes` gets a part's bytes:
``data:`` URLs always, ``http(s)`` URLs only for hosts in ``--allowed-media-domains``, fetched as images are
(`jax_sparse_kv.server.images.fetch_media`: no redirects, at most ``--max-video-bytes`` + 1 bytes read);
`decode_video` turns a container's bytes into ``[T, H, W, 3]`` uint8 frames and the stream's frames per second
(the source fps the timestamps need), within limits: bytes (413), frames and pixels per frame (400). A broken
video is a 400 naming its part. The chat route (`jax_sparse_kv.server.state`) calls them.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_sparse_kv.server.images import ImageError, fetch_media

__all__ = ["VideoSource", "decode_video", "video_sources", "is_video_part", "data_url_bytes", "video_bytes"]

VIDEO_PART_TYPES = ("video_url",)


@dataclasses.dataclass(frozen=True)
class VideoSource:
    url: str
    param: str  # where in the request: messages.{i}.content.{j}


def is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in VIDEO_PART_TYPES


def video_sources(messages: Sequence[Any]) -> list[VideoSource]:
    """The video parts of chat messages (pydantic messages or dicts), in the order the prompt holds them."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) and hasattr(part, "model_dump"):
                part = part.model_dump()
            if is_video_part(part):
                param = f"messages.{i}.content.{j}"
                value = part.get("video_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str) or not url:
                    raise ImageError(400, f"{param}: a video part needs 'video_url': {{'url': '...'}}", param)
                out.append(VideoSource(url, param))
    return out


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:video/...;base64,`` URL; 400 for another URL or bad base64, 413 over `max_bytes`."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError(400, f"{param}: a video URL must be data:video/...;base64,...", param)
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageError(413, f"{param}: the video is over the limit of {max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(400, f"{param}: the video's base64 does not decode", param) from None


def video_bytes(
    url: str, param: str, max_bytes: int, *, allowed_domains: Sequence[str] = (), timeout_s: float = 10.0
) -> bytes:
    """The bytes of a video part's URL: a ``data:`` URL's payload, or an http(s) URL's download from a host in
    `allowed_domains` (``--allowed-media-domains``; the fetch is the images' one, `fetch_media`).

    Raises:
        ImageError: 400 for a bad data URL, another scheme, a host not allowed or a failed fetch; 413 for more
            than `max_bytes` bytes (``--max-video-bytes``), found while downloading (no more is read).
    """
    if url[:5].lower() == "data:":
        return data_url_bytes(url, param, max_bytes)
    data = fetch_media(
        url, param, media="video", allowed_domains=allowed_domains, max_bytes=max_bytes, timeout_s=timeout_s
    )
    if len(data) > max_bytes:
        raise ImageError(413, f"{param}: the video is over the limit of {max_bytes} bytes (--max-video-bytes)", param)
    return data


def decode_video(
    data: bytes, param: str = "video", *, max_frames: int = 768, max_pixels: int = 4096 * 4096
) -> tuple[np.ndarray, float | None]:
    """``(frames [T, H, W, 3] uint8, fps)`` of a video container's first video stream (PyAV).

    Raises:
        ImageError: 400 for a video PyAV cannot decode, one without frames, over `max_frames` frames or with
            frames over `max_pixels`; 500-free: every decoder error is a 400 naming `param`.
        ImportError: PyAV is not installed (``pip install -e ".[video]"``).
    """
    import av

    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ImageError(400, f"{param}: the file holds no video stream", param)
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else None
            for frame in container.decode(stream):
                if frame.width * frame.height > max_pixels:
                    raise ImageError(
                        400,
                        f"{param}: a frame of {frame.width} x {frame.height} is over the limit of {max_pixels} pixels",
                        param,
                    )
                if len(frames) == max_frames:
                    raise ImageError(
                        400, f"{param}: the video has more than --max-video-frames={max_frames} frames", param
                    )
                frames.append(frame.to_ndarray(format="rgb24"))
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the decoder says, the client's file is broken
        raise ImageError(400, f"{param}: the video does not decode ({type(e).__name__}: {e})", param) from None
    if not frames:
        raise ImageError(400, f"{param}: the video has no frames", param)
    return np.stack(frames), fps
