"""One source image in, JPEG bytes out: the per-file work that conversion runs in worker processes."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# PIL refuses images over ~179 Mpx as a "decompression bomb"; real datasets (satellite, pathology)
# exceed it, and we decode to check, not to trust.
Image.MAX_IMAGE_PIXELS = None

# JPEG modes every decoder (PIL, DALI/nvJPEG, torchvision) turns into the same RGB: pass through as-is.
PASSTHROUGH_JPEG_MODES = {"RGB", "L"}


@dataclass
class EncodedImage:
    jpeg: bytes
    width: int
    height: int
    reencoded: str | None  # why it was re-encoded (e.g. "png", "cmyk-jpeg", "max_side"), None if passed through


class ImageError(Exception):
    """The file is not a decodable image; the message says why."""


def decode_check(data: bytes) -> Image.Image:
    """Fully decode `data` (a header peek would miss truncation and corrupt scans) and return the image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            img.load()
    except UnidentifiedImageError:
        raise ImageError("not an image (PIL cannot identify its content)") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise ImageError(f"corrupt or truncated image: {e}") from None
    if img.width < 1 or img.height < 1:
        raise ImageError(f"empty image ({img.width}x{img.height})")
    return img


def to_jpeg(data: bytes, quality: int, max_side: int | None) -> EncodedImage:
    """Decode-check `data`; return it unchanged when it is a plain JPEG within `max_side`, else re-encode
    it to an RGB JPEG (shrunk so its long side is `max_side`)."""
    img = decode_check(data)
    width, height = img.size
    too_big = max_side is not None and max(width, height) > max_side
    fmt = (img.format or "unknown").lower()
    if fmt == "jpeg" and img.mode in PASSTHROUGH_JPEG_MODES and not too_big:
        return EncodedImage(data, width, height, None)

    reason = "max_side" if too_big else (f"{img.mode.lower()}-jpeg" if fmt == "jpeg" else fmt)
    rgb = _to_rgb(img)
    if too_big:
        scale = max_side / max(width, height)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        rgb = rgb.resize(size, Image.BICUBIC, reducing_gap=3.0)
    buf = io.BytesIO()
    rgb.save(buf, format="JPEG", quality=quality)
    return EncodedImage(buf.getvalue(), rgb.width, rgb.height, reason)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB as PIL's `convert` gives it, except transparency, which is composited on white rather than
    dropped (dropping it turns transparent areas into whatever colour they happen to store)."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")
