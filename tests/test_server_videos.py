"""server/videos.py: video parts of chat messages, data URLs and decoding with PyAV (the ``video`` extra)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from jax_sparse_kv import multimodal as mm
from jax_sparse_kv.server.images import ImageError
from jax_sparse_kv.server.videos import data_url_bytes, decode_video, video_sources

av = pytest.importorskip("av")


def mp4(frames: int, height: int = 64, width: int = 96, fps: int = 5) -> bytes:
    """A small MPEG-4 video made in memory (smooth gradients that survive the lossy codec)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            y, x = np.mgrid[0:height, 0:width]
            rgb = np.stack([(x * 2 + i * 10) % 256, (y * 3) % 256, np.full_like(x, 40 * i % 256)], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_decode_then_process():
    frames, fps = decode_video(mp4(7))
    assert frames.shape == (7, 64, 96, 3) and frames.dtype == np.uint8 and fps == 5.0
    batch = mm.VideoProcessor()(frames, fps=fps)
    assert batch.grid_thw.tolist() == [[4, 4, 6]] and batch.timestamps == [0.0, 0.4, 0.8, 1.2]


def test_video_parts_and_limits():
    url = "data:video/mp4;base64," + base64.b64encode(mp4(3)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "video_url",
                                                                             "video_url": {"url": url}}]}]  # fmt: skip
    (source,) = video_sources(messages)
    assert source.param == "messages.0.content.1"
    data = data_url_bytes(source.url, source.param, max_bytes=10**6)
    with pytest.raises(ImageError, match="limit of 100 bytes") as e:
        data_url_bytes(source.url, source.param, max_bytes=100)
    assert e.value.status == 413
    with pytest.raises(ImageError, match="max-video-frames=2") as e:
        decode_video(data, source.param, max_frames=2)
    assert e.value.status == 400
    with pytest.raises(ImageError, match="does not decode"):
        decode_video(b"not a video", "messages.0.content.1")
    with pytest.raises(ImageError, match="over the limit of 100 pixels"):
        decode_video(data, max_pixels=100)
