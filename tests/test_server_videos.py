"""server/videos.py: video parts of chat messages, data URLs and decoding with PyAV (the ``video`` extra)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from jax_sparse_kv import multimodal as mm
from jax_sparse_kv.server.images import ImageError
from jax_sparse_kv.server.videos import data_url_bytes, decode_video, video_bytes, video_sources

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
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "video_url", "video_url": {"url": url}}]}
    ]
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
    tok.add_special_tokens(
        [
            mm.processor.IMAGE_TOKEN,
            mm.processor.VIDEO_TOKEN,
            mm.processor.VISION_START_TOKEN,
            mm.processor.VISION_END_TOKEN,
        ]
    )  # ids 508, 509, 510, 511
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": DEMO_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12544}))
    vision = tiny_vision_config(
        image_token_id=508, video_token_id=509, image_start_token_id=510, image_end_token_id=511
    )
    model = MiniMaxM3(tiny_config(vocab_size=512, vision=vision), seed=0)
    from support.vl_reference import sharpen

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
    from support.server_process import Server
    from support.serving_reference import one_bucket

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving import Engine, SamplingParams

    path = tmp_path / "vl"
    _vl_checkpoint(path)
    flags = dict(num_pages=64, page_size=8, max_seqs=2, max_tokens_per_step=16)
    server = Server(
        "--checkpoint",
        str(path),
        "--dtype",
        "f32",
        "--max-video-frames",
        "8",
        "--served-model-name",
        "vl",
        *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()),
    )
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
        engine = Engine(MiniMaxM3.from_pretrained(str(path)), dtype=jnp.float32, **one_bucket(flags))
        rid = engine.add_request(out.input_ids, SamplingParams(max_tokens=6, ignore_eos=True), videos=out.videos)
        expected = None
        while engine.has_unfinished_requests():
            expected = next((o.token_ids for o in engine.step() if o.request_id == rid and o.finished), expected)

        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="vl",
            messages=[{"role": "user", "content": content}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = reply.model_dump()["choices"][0]
        assert choice["token_ids"] == expected and choice["prompt_token_ids"] == out.input_ids
        assert len(set(expected)) > 1
        bad = [
            ({"url": "data:video/mp4;base64," + base64.b64encode(b"junk").decode()}, "does not decode"),
            ({"url": "data:video/mp4;base64," + base64.b64encode(mp4(12)).decode()}, "max-video-frames=8"),
        ]
        for part, message in bad:
            with pytest.raises(openai.BadRequestError, match=message) as e:
                client.chat.completions.create(
                    model="vl",
                    max_tokens=2,
                    messages=[{"role": "user", "content": [{"type": "video_url", "video_url": part}]}],
                )
            assert e.value.body["param"] == "messages.0.content.0"
        again = client.chat.completions.create(
            model="vl",
            messages=[{"role": "user", "content": content}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert again.model_dump()["choices"][0]["token_ids"] == expected
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------------- http(s) URLs under --allowed-media-domains


@pytest.fixture
def video_host():
    """A local HTTP server holding ``/clip.mp4`` (7 frames) and ``/long.mp4`` (40 frames): its base URL."""
    import http.server
    import threading

    files = {"/clip.mp4": mp4(7), "/long.mp4": mp4(40)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", files
    finally:
        httpd.shutdown()


def test_video_urls_of_allowed_hosts_are_fetched_within_the_limit(video_host):
    """An allowed host's video is the same bytes (and frames) as the data URL; a host outside
    --allowed-media-domains, a server without it, a failed fetch and a download over --max-video-bytes are errors
    naming the part and the cause."""
    base, files = video_host
    allowed = ("127.0.0.1",)
    data = video_bytes(f"{base}/clip.mp4", "p", 10**6, allowed_domains=allowed)
    assert data == files["/clip.mp4"]
    url = "data:video/mp4;base64," + base64.b64encode(files["/clip.mp4"]).decode()
    assert video_bytes(url, "p", 10**6) == data
    np.testing.assert_array_equal(decode_video(data)[0], decode_video(data_url_bytes(url, "p", 10**6))[0])
    errors = [
        (dict(allowed_domains=("*.example.com",)), 400, "host '127.0.0.1' is not among --allowed-media-domains"),
        (dict(), 400, "does not fetch video URLs.*--allowed-media-domains"),
    ]
    for kwargs, status, message in errors:
        with pytest.raises(ImageError, match=message) as e:
            video_bytes(f"{base}/clip.mp4", "messages.0.content.1", 10**6, **kwargs)
        assert e.value.status == status and e.value.param == "messages.0.content.1"
    with pytest.raises(ImageError, match="cannot fetch the video: .*404") as e:
        video_bytes(f"{base}/missing.mp4", "p", 10**6, allowed_domains=allowed)
    assert e.value.status == 400
    limit = len(files["/long.mp4"]) - 1
    with pytest.raises(ImageError, match=f"over the limit of {limit} bytes \\(--max-video-bytes\\)") as e:
        video_bytes(f"{base}/long.mp4", "p", limit, allowed_domains=allowed)
    assert e.value.status == 413
    with pytest.raises(ImageError, match="video URLs must be data: URLs"):
        video_bytes("file:///etc/passwd", "p", 10**6, allowed_domains=allowed)


@pytest.mark.slow  # a VL server: ~15 s
def test_a_video_url_through_the_server_equals_the_data_url(tmp_path, video_host):
    """Served with --allowed-media-domains 127.0.0.1: an http video URL's answer equals the same video's data URL
    answer; a host not allowed and a download over --max-video-bytes are errors naming the cause, and the server
    serves on."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from support.server_process import Server

    base, files = video_host
    path = tmp_path / "vl"
    _vl_checkpoint(path)
    limit = len(files["/long.mp4"]) - 1
    server = Server(
        "--checkpoint",
        str(path),
        "--dtype",
        "f32",
        "--max-video-frames",
        "64",
        "--served-model-name",
        "vl",
        "--num-pages=64",
        "--page-size=8",
        "--max-seqs=2",
        "--max-tokens-per-step=16",
        "--allowed-media-domains",
        "127.0.0.1",
        f"--max-video-bytes={limit}",
    )
    try:
        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(url: str) -> dict:
            content = [{"type": "text", "text": "What happens? "}, {"type": "video_url", "video_url": {"url": url}}]
            reply = client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": content}],
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choice = reply.model_dump()["choices"][0]
            return {k: choice[k] for k in ("token_ids", "prompt_token_ids")}

        expected = ask("data:video/mp4;base64," + base64.b64encode(files["/clip.mp4"]).decode())
        assert ask(f"{base}/clip.mp4") == expected
        with pytest.raises(openai.BadRequestError, match="not among --allowed-media-domains") as e:
            ask(base.replace("127.0.0.1", "localhost") + "/clip.mp4")
        assert e.value.body["param"] == "messages.0.content.1"
        with pytest.raises(openai.APIStatusError, match=f"limit of {limit} bytes \\(--max-video-bytes\\)") as e:
            ask(f"{base}/long.mp4")
        assert e.value.status_code == 413
        assert ask(f"{base}/clip.mp4") == expected
    finally:
        assert server.stop() == 0
