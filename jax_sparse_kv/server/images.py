"""Images in chat requests: which content parts are images, where their bytes come from, and the limits.

A chat message's ``content`` may hold image parts, in OpenAI's two spellings::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   # chat completions
    {"type": "input_image", "image_url": "data:image/png;base64,..."}          # the Responses API's

`image_sources` finds them in order (with the request path each came from, for error messages);
`ImageLoader.load` turns each into an RGB image: ``data:`` URLs always; ``http(s)`` URLs only for hosts in
``--allowed-media-domains`` (none by default: no request can make the server fetch an arbitrary address;
redirects are not followed). Every image is limited in bytes (413) and pixels (400); a broken one is a 400
naming its part. The decoding itself is `jax_sparse_kv.multimodal.media`'s.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ImageSource",
    "ImageError",
    "ImageLoader",
    "image_sources",
    "is_image_part",
    "domain_allowed",
    "fetch_media",
]

IMAGE_PART_TYPES = ("image_url", "input_image")


class ImageError(ValueError):
    """A bad image part: ``status`` (400 or 413), the message, and ``param`` (``messages.1.content.2``)."""

    def __init__(self, status: int, message: str, param: str):
        super().__init__(message)
        self.status, self.param = status, param


@dataclasses.dataclass(frozen=True)
class ImageSource:
    url: str
    param: str  # where in the request: messages.{i}.content.{j}


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _url_of(part: dict, param: str) -> str:
    value = part.get("image_url", part.get("input_image"))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageError(
            400,
            f"{param}: an image part needs 'image_url': {{'url': '...'}} (or 'image_url': '...' for 'input_image')",
            param,
        )
    return value


def image_sources(messages: Sequence[Any]) -> list[ImageSource]:
    """The image parts of chat messages (pydantic messages or dicts), in the order the prompt holds them."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            part = part if isinstance(part, dict) else part.model_dump()
            if is_image_part(part):
                param = f"messages.{i}.content.{j}"
                out.append(ImageSource(_url_of(part, param), param))
    return out


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} not followed", headers, fp)


@dataclasses.dataclass(frozen=True)
class ImageLoader:
    """Turns image sources into RGB PIL images within the server's limits.

    Attributes:
      allowed_domains: hosts whose http(s) image URLs the server fetches (exact names, or ``*.example.com``
        for its subdomains); empty: only ``data:`` URLs.
      max_image_bytes: the largest encoded image (data URL payload or download); above it: 413.
      max_request_image_bytes: the encoded images of one request together; above it: 413.
      max_images: image parts in one request; above it: 400.
      max_image_pixels: width x height an image may decode to (a decompression bomb is a 400, not a crash).
      timeout_s: seconds to fetch one URL.
    """

    allowed_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 2**20
    max_request_image_bytes: int = 64 * 2**20
    max_images: int = 16
    max_image_pixels: int = 64 * 2**20
    timeout_s: float = 10.0

    def load(self, sources: Sequence[ImageSource]) -> list[Any]:
        """One RGB image per source, in order. Raises `ImageError` (400 or 413) naming the part."""
        if len(sources) > self.max_images:
            param = sources[self.max_images].param
            raise ImageError(
                400,
                f"{len(sources)} images in one request; the server takes at most "
                f"{self.max_images} (--max-images-per-request)",
                param,
            )
        from jax_sparse_kv.multimodal.media import decode_data_url, load_image

        images, total = [], 0
        for src in sources:
            if src.url[:5].lower() == "data:":
                try:
                    _, data = decode_data_url(src.url)
                except ValueError as e:
                    raise ImageError(400, f"{src.param}: {e}", src.param) from None
            else:
                data = self._fetch(src)
            if len(data) > self.max_image_bytes:
                raise ImageError(
                    413,
                    f"{src.param}: the image has {len(data)} bytes; the server takes at most "
                    f"{self.max_image_bytes} per image (--max-image-bytes)",
                    src.param,
                )
            total += len(data)
            if total > self.max_request_image_bytes:
                raise ImageError(
                    413,
                    f"{src.param}: the request's images reach {total} bytes; the server takes at "
                    f"most {self.max_request_image_bytes} per request (--max-request-image-bytes)",
                    src.param,
                )
            try:
                images.append(load_image(data, max_image_pixels=self.max_image_pixels))
            except ValueError as e:
                raise ImageError(400, f"{src.param}: {e}", src.param) from None
        return images

    def _allowed(self, host: str) -> bool:
        return domain_allowed(host, self.allowed_domains)

    def _fetch(self, src: ImageSource) -> bytes:
        return fetch_media(
            src.url,
            src.param,
            media="image",
            allowed_domains=self.allowed_domains,
            max_bytes=self.max_image_bytes,
            timeout_s=self.timeout_s,
        )


def domain_allowed(host: str, allowed_domains: Sequence[str]) -> bool:
    """Whether `host` is one of `allowed_domains` (exact names; ``*.example.com``: its subdomains)."""
    host = host.lower().rstrip(".")
    for domain in allowed_domains:
        domain = domain.lower().rstrip(".")
        if host == domain or (domain.startswith("*.") and host.endswith(domain[1:])):
            return True
    return False


def fetch_media(
    url: str, param: str, *, media: str, allowed_domains: Sequence[str], max_bytes: int, timeout_s: float = 10.0
) -> bytes:
    """The bytes at an http(s) `url` of a host among `allowed_domains` (``--allowed-media-domains``): the one
    place that decides what the server fetches, for images and videos (`media` names it in the messages).

    Reads at most ``max_bytes + 1`` bytes (the caller tells the client its limit if there are more); redirects
    are not followed. Raises `ImageError` (400 naming `param`) for another scheme, a server without allowed
    domains, a host not among them, or a failed fetch.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ImageError(
            400,
            f"{param}: {media} URLs must be data: URLs (or http(s) URLs of allowed "
            f"domains), got scheme {parsed.scheme!r}",
            param,
        )
    if not allowed_domains:
        raise ImageError(
            400,
            f"{param}: this server does not fetch {media} URLs; send the {media} as a data: "
            "URL (or start the server with --allowed-media-domains)",
            param,
        )
    if not parsed.hostname or not domain_allowed(parsed.hostname, allowed_domains):
        raise ImageError(400, f"{param}: host {parsed.hostname!r} is not among --allowed-media-domains", param)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(400, f"{param}: cannot fetch the {media}: {e}", param) from None
