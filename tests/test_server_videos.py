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


# ---------------------------------------------------------------------- through a real server


def _vl_checkpoint(path) -> None:
    """A tiny random VL checkpoint whose tokenizer has M3's four vision tokens (image, video, start, end)."""
    import json

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config
    from jax_sparse_kv.nn.weights import save_pretrained
    from jax_sparse_kv.server.tokenizer import DEMO_CHAT_TEMPLATE, TextTokenizer

    tok = TextTokenizer.demo(508).tokenizer
    tok.add_special_tokens([mm.processor.IMAGE_TOKEN, mm.processor.VIDEO_TOKEN, mm.processor.VISION_START_TOKEN,
                            mm.processor.VISION_END_TOKEN])  # ids 508, 509, 510, 511  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": DEMO_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}))  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12544}))
    vision = tiny_vision_config(image_token_id=508, video_token_id=509, image_start_token_id=510,
                                image_end_token_id=511)  # fmt: skip
    model = MiniMaxM3(tiny_config(vocab_size=512, vision=vision), seed=0)
    from test_serving_images import sharpen

    sharpen(model, seed=1)  # outputs that follow the vision features, not one repeated token
    save_pretrained(model, path)


@pytest.mark.slow  # a VL server and an in-process engine: ~20 s (the default run stays near 5 minutes)
def test_a_video_part_through_the_server_equals_the_engine(tmp_path):
    """A chat video part (data URL, decoded with PyAV): the server's greedy tokens equal an in-process engine's on
    the prompt transformers' processor writes (timestamps per temporal patch); broken and too long videos are
    400s naming the part, and the server serves on."""
    import jax.numpy as jnp

    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_server import Server

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving import Engine, SamplingParams

    path = tmp_path / "vl"
    _vl_checkpoint(path)
    flags = dict(num_pages=64, page_size=8, max_seqs=2, max_tokens_per_step=16)
    server = Server("--checkpoint", str(path), "--dtype", "f32", "--max-video-frames", "8", "--served-model-name",
                    "vl", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()))  # fmt: skip
    try:
        video = mp4(7)
        url = "data:video/mp4;base64," + base64.b64encode(video).decode()
        content = [{"type": "text", "text": "What happens? "}, {"type": "video_url", "video_url": {"url": url}}]
        # the reference, while the server starts: the same template, processor and model in process
        tok = TextTokenizer.from_dir(str(path))
        # (the server joins a message's parts with a newline, as for images)
        text = tok.apply_chat_template([{"role": "user", "content": "What happens? \n" + mm.processor.VIDEO_TOKEN}])
        frames, fps = decode_video(video)
        processor = mm.Processor(tok, mm.ImageProcessor.from_pretrained(path), mm.VideoProcessor.from_pretrained(path))
        out = processor(text=text, videos=[frames], video_fps=[fps], add_special_tokens=False)
        assert "0.0 seconds" in tok.decode(out.input_ids, skip_special_tokens=False)
        engine = Engine(MiniMaxM3.from_pretrained(str(path)), dtype=jnp.float32, **flags)
        rid = engine.add_request(out.input_ids, SamplingParams(max_tokens=6, ignore_eos=True), videos=out.videos)
        expected = None
        while engine.has_unfinished_requests():
            expected = next((o.token_ids for o in engine.step() if o.request_id == rid and o.finished), expected)

        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        choice = reply.model_dump()["choices"][0]
        assert choice["token_ids"] == expected and choice["prompt_token_ids"] == out.input_ids
        assert len(set(expected)) > 1
        bad = [({"url": "data:video/mp4;base64," + base64.b64encode(b"junk").decode()}, "does not decode"),
               ({"url": "data:video/mp4;base64," + base64.b64encode(mp4(12)).decode()}, "max-video-frames=8")]
        for part, message in bad:
            with pytest.raises(openai.BadRequestError, match=message) as e:
                client.chat.completions.create(model="vl", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": part}]}])  # fmt: skip
            assert e.value.body["param"] == "messages.0.content.0"
        again = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert again.model_dump()["choices"][0]["token_ids"] == expected
    finally:
        assert server.stop() == 0
