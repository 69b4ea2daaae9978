"""The server with images: the official `openai` client sends data URLs to a real server process.

A tiny random VL checkpoint (vision tower + projector, transformers' VL names) with a tokenizer that has
M3's image tokens (`]<]image[>[`, `]<]start of image[>[`, `]<]end of image[>[`; config.json names only
the image token, so the start/end ids come from tokenizer.json) and a preprocessor_config.json. The
server's greedy tokens must equal an in-process `Engine`'s on the same prompt and image; broken,
oversized and remote images get the documented errors.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL")

from PIL import Image  # noqa: E402
from support.server_process import Server  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

from jax_sparse_kv.nn import MiniMaxM3  # noqa: E402
from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config  # noqa: E402
from jax_sparse_kv.nn.weights import save_pretrained  # noqa: E402

FLAGS = (
    "--num-pages",
    "64",
    "--page-size",
    "8",
    "--max-seqs",
    "2",
    "--max-tokens-per-step",
    "16",
    "--dtype",
    "f32",
    "--max-image-bytes",
    "60000",
)
IMAGE_TOKENS = ("]<]image[>[", "]<]start of image[>[", "]<]end of image[>[")


def write_checkpoint(path) -> None:
    from jax_sparse_kv.server.tokenizer import DEMO_CHAT_TEMPLATE, TextTokenizer

    tok = TextTokenizer.demo(509).tokenizer
    tok.add_special_tokens(list(IMAGE_TOKENS))  # ids 509, 510, 511
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": DEMO_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12544}))
    vision = tiny_vision_config(image_token_id=509, image_start_token_id=None, image_end_token_id=None)
    model = MiniMaxM3(tiny_config(vocab_size=512, vision=vision), seed=0)
    from support.vl_reference import sharpen

    sharpen(model, seed=1)
    save_pretrained(model, path)


def png(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMG = np.random.default_rng(4).integers(0, 256, size=(70, 90, 3), dtype=np.uint8)  # resized to 56 x 84: 6 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl_server") / "ckpt"
    write_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint):
    server = Server("--checkpoint", checkpoint, *FLAGS)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    server.wait_healthy()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_chat_with_an_image_equals_the_engine(checkpoint, client):
    from jax_sparse_kv import multimodal as mm
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving import Engine, SamplingParams

    messages = user(
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": data_url(png(IMG))}},
        {"type": "text", "text": "this picture?"},
    )
    reply = client.chat.completions.create(
        model="ckpt", messages=messages, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    ).model_dump()
    # the reference: the same rendered prompt (the image part as the tokenizer's placeholder) through an Engine
    tok = TextTokenizer.from_dir(checkpoint)
    text = tok.apply_chat_template([{"role": "user", "content": "What is in\n]<]image[>[\nthis picture?"}])
    model = MiniMaxM3.from_pretrained(checkpoint)
    engine = Engine(
        model,
        num_pages=64,
        page_size=8,
        dtype=np.float32,
        **one_bucket(dict(max_seqs=2, max_tokens_per_step=16)),  # the server's programs
        image_processor=mm.ImageProcessor.from_pretrained(checkpoint),
    )
    (want,) = engine.generate(
        [tok.encode(text, add_special_tokens=False)],
        SamplingParams(max_tokens=8, temperature=0.0),
        images=[[Image.fromarray(IMG)]],
    )
    assert reply["choices"][0]["token_ids"] == want.token_ids
    assert reply["usage"]["prompt_tokens"] == len(want.prompt_token_ids)  # the expanded prompt is counted
    assert len(want.prompt_token_ids) == len(tok.encode(text, add_special_tokens=False)) + 6 + 1


def test_the_image_changes_the_answer_and_input_image_parts_work(client):
    other = np.full_like(IMG, 200)
    a = client.chat.completions.create(
        model="ckpt",
        messages=user({"type": "input_image", "image_url": data_url(png(IMG))}),
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]["token_ids"]
    b = client.chat.completions.create(
        model="ckpt",
        messages=user({"type": "input_image", "image_url": data_url(png(other, "JPEG"), "image/jpeg")}),
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).model_dump()["choices"][0]["token_ids"]
    assert a != b


@pytest.mark.parametrize(
    "part, status, message",
    [
        ({"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}, 400, "cannot decode image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, 400, "base64"),
        ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}, 400, "does not fetch"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, 400, "scheme"),
        ({"type": "image_url", "image_url": {}}, 400, "needs 'image_url'"),
        (
            {
                "type": "image_url",
                "image_url": {
                    "url": data_url(png(np.random.default_rng(0).integers(0, 256, (160, 160, 3), dtype=np.uint8)))
                },
            },
            413,
            "at most 60000",
        ),
    ],
)
def test_bad_images_get_an_error_naming_the_part(client, part, status, message):
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="ckpt", messages=user({"type": "text", "text": "hi"}, part), max_tokens=2)
    assert err.value.status_code == status
    body = err.value.response.json()["error"]
    assert message in body["message"] and body["param"] == "messages.0.content.1", body


def test_a_text_model_refuses_image_parts():
    from jax_sparse_kv.server.protocol import APIError
    from jax_sparse_kv.server.state import template_message

    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    from jax_sparse_kv.server.protocol import ChatMessage

    with pytest.raises(APIError, match="takes no images"):
        template_message(0, ChatMessage(**msg), None)
    assert template_message(0, ChatMessage(**msg), "<img>")["content"] == "<img>"


# ---------------------------------------------------------------------- the loader alone (no server)


def test_loader_fetches_only_allowed_hosts_and_never_follows_redirects():
    """A local HTTP server holds an image and a redirect: the allowed host's image loads, the redirect does not,
    and a host outside the list is refused before any connection."""
    import http.server
    import threading

    from jax_sparse_kv.server.images import ImageError, ImageLoader, ImageSource

    body = png(IMG)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/")
                self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        loader = ImageLoader(allowed_domains=("127.0.0.1",))
        (image,) = loader.load([ImageSource(f"{base}/cat.png", "messages.0.content.0")])
        np.testing.assert_array_equal(np.asarray(image), IMG)
        with pytest.raises(ImageError, match="cannot fetch the image: .*redirect") as err:
            loader.load([ImageSource(f"{base}/elsewhere", "messages.0.content.1")])
        assert err.value.status == 400 and err.value.param == "messages.0.content.1"
        with pytest.raises(ImageError, match="not among --allowed-media-domains"):
            ImageLoader(allowed_domains=("*.example.com",)).load([ImageSource(f"{base}/cat.png", "p")])
        assert ImageLoader(allowed_domains=("*.example.com",))._allowed("img.example.com")
        assert not ImageLoader(allowed_domains=("*.example.com",))._allowed("example.com.evil.net")
        small = ImageLoader(allowed_domains=("127.0.0.1",), max_request_image_bytes=len(body) + 10)
        with pytest.raises(ImageError, match="per request") as err:
            small.load([ImageSource(f"{base}/cat.png", "a"), ImageSource(data_url(body), "b")])
        assert err.value.status == 413 and err.value.param == "b"
    finally:
        httpd.shutdown()
