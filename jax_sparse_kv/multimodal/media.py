"""What an HTTP client sends for an image, turned into a PIL image (for the server's ``image_url`` parts).

- `decode_data_url`: ``data:image/png;base64,...`` -> ``(mime type, bytes)``;
- `load_image`: encoded bytes (PNG, JPEG, WebP, GIF: its first frame) -> an RGB ``PIL.Image.Image``, decoded in
  full, with a pixel limit checked before any pixel is decoded.

Every failure is a ``ValueError`` with a message a client can be shown (a server answers 400); a wrong argument
type is a ``TypeError``. Pillow (the ``images`` extra) is imported on first use.

Compared with transformers' ``load_image``: the same EXIF orientation (``ImageOps.exif_transpose``), but
transparency is composited onto white (as transformers' image processor and vLLM do) where transformers'
``load_image`` drops the alpha channel with ``convert("RGB")``.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import urllib.parse
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["IMAGE_FORMATS", "decode_data_url", "load_image"]

#: The formats `load_image` decodes (Pillow's names); others are refused before Pillow tries its other plugins.
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")

# warnings.catch_warnings changes process-wide state: one thread at a time here
_OPEN_LOCK = threading.Lock()


def _preview(text: str, limit: int = 48) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def decode_data_url(url: str) -> tuple[str, bytes]:
    """The mime type and bytes of an image data URL (RFC 2397): ``data:image/png;base64,iVBOR...``.

    The mime type is lowercased, without parameters. Whitespace in a base64 payload (line breaks) is dropped and
    missing ``=`` padding is tolerated; a payload without ``;base64`` is percent-decoded.

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: not a ``data:`` URL, no comma, a mime type that is not ``image/*``, a bad base64 payload, an
            empty payload.
    """
    if not isinstance(url, str):
        raise TypeError(f"a data URL must be a string, got {type(url).__name__}")
    if url[:5].lower() != "data:":
        raise ValueError(f"not a data URL (expected 'data:image/...;base64,...'): {_preview(url)}")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ValueError(f"malformed data URL, no ',' after the media type: {_preview(url)}")
    params = [p.strip() for p in header.split(";")]
    is_base64 = len(params) > 1 and params[-1].lower() == "base64"
    mime = params[0].lower() or "text/plain"  # RFC 2397's default
    if not mime.startswith("image/") or mime == "image/":
        raise ValueError(f"data URL media type {mime!r} is not an image type (image/png, image/jpeg, ...)")
    if is_base64:
        compact = "".join(payload.split())
        if len(compact) % 4:
            compact += "=" * (-len(compact) % 4)
        try:
            data = base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"invalid base64 payload in data URL ({mime}): {e}") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        raise ValueError(f"empty payload in data URL ({mime})")
    return mime, data


def load_image(data: bytes, *, max_image_pixels: int | None = None) -> Image.Image:
    """Decode an encoded image (PNG, JPEG, WebP, GIF's first frame) into an RGB PIL image.

    The header is read first: an image larger than ``max_image_pixels`` (width * height) is refused before its
    pixels are decoded. Pillow's own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, about 89M pixels
    by default) applies too, as a ``ValueError`` rather than Pillow's warning or ``DecompressionBombError``. The
    whole image is then decoded (a truncated file fails here, not later), the EXIF orientation applied, and the
    result converted to RGB, transparency composited onto white.

    Args:
        data: the encoded file's bytes (``bytes``, ``bytearray`` or ``memoryview``).
        max_image_pixels: the most pixels (width * height) accepted; None for no limit but Pillow's.

    Returns:
        An ``RGB`` ``PIL.Image.Image``, fully loaded.

    Raises:
        TypeError: ``data`` is not bytes-like.
        ValueError: ``cannot decode image: ...`` for bytes that are not a complete image of an accepted format;
            ``image too large: ...`` over either pixel limit.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    if max_image_pixels is not None and (not isinstance(max_image_pixels, int) or max_image_pixels <= 0):
        raise ValueError(f"max_image_pixels must be a positive int or None, got {max_image_pixels!r}")
    if len(data) == 0:
        raise ValueError("cannot decode image: no data")
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)), formats=list(IMAGE_FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"image too large: {e}") from None
    except UnidentifiedImageError:
        accepted = ", ".join(IMAGE_FORMATS)
        raise ValueError(
            f"cannot decode image: not a {accepted} file ({len(data)} bytes starting {bytes(data[:8])!r})"
        ) from None
    except Exception as e:  # a plugin failing on a corrupt header: OSError, SyntaxError, struct.error, ...
        raise ValueError(f"cannot decode image: {type(e).__name__}: {e}") from None
    width, height = image.size
    if max_image_pixels is not None and width * height > max_image_pixels:
        raise ValueError(
            f"image too large: {width} x {height} = {width * height} pixels, more than max_image_pixels="
            f"{max_image_pixels}"
        )
    try:
        image.load()  # decodes every pixel: a truncated or corrupt file fails here
        image = ImageOps.exif_transpose(image)
    except Exception as e:
        raise ValueError(f"cannot decode image ({image.format}, {width} x {height}): {type(e).__name__}: {e}") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency (an alpha band or a palette's transparent index) composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
