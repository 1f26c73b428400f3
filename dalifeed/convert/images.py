"""One source image in, JPEG bytes out: the per-file work that conversion runs in worker processes.

The rule (docs/format.md): a JPEG passes through byte for byte only when every decoder that will ever
read it -- PIL, DALI's CPU decoder (libjpeg-turbo) and nvJPEG on the GPU -- turns it into the same
pixels. That is read from the frame header (`read_jpeg_frame`), not from the file name or PIL's mode:
Huffman-coded sequential or progressive DCT (SOF0, SOF1, SOF2), 8-bit samples, one component (grey) or
three (YCbCr), no EXIF rotation. Anything else PIL decodes is re-encoded to a standard RGB JPEG, and
the reason is recorded; what PIL cannot decode is skipped with a reason that says what it is.
"""

from __future__ import annotations

import io
import struct
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from ..format import DEFAULT_MAX_PIXELS  # noqa: F401  (the converters import it from here)

EXIF_ORIENTATION = 0x0112

# Start-of-frame markers (ITU T.81 table B.1): the coding process of the image that follows.
SOF_PROCESS = {
    0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive", 0xC3: "lossless",
    0xC5: "hierarchical sequential", 0xC6: "hierarchical progressive", 0xC7: "hierarchical lossless",
    0xC9: "arithmetic-coded sequential", 0xCA: "arithmetic-coded progressive", 0xCB: "arithmetic-coded lossless",
    0xCD: "hierarchical arithmetic-coded sequential", 0xCE: "hierarchical arithmetic-coded progressive",
    0xCF: "hierarchical arithmetic-coded lossless",
}
# The Huffman-coded DCT processes nvJPEG decodes (its encodings BASELINE_DCT, EXTENDED_SEQUENTIAL_DCT_HUFFMAN,
# PROGRESSIVE_DCT_HUFFMAN), as do libjpeg-turbo and PIL.
PORTABLE_SOF = {0xC0, 0xC1, 0xC2}
LOSSLESS_SOF = {0xC3, 0xC7, 0xCB, 0xCF}
ARITHMETIC_SOF = {0xC9, 0xCA, 0xCD, 0xCE}
HIERARCHICAL_SOF = {0xC5, 0xC6}

# Magic numbers of image formats, to tell "an image we cannot read" from "not an image at all".
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"), (b"\xff\x0a", "JPEG XL"), (b"8BPS", "PSD"), (b"BM", "BMP"),
)
_HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis"}
# Formats this Pillow cannot decode at all: such a file is an image we do not support, not a damaged one.
_UNDECODABLE = {"JPEG XL", "HEIF/AVIF"}


@dataclass(frozen=True)
class JpegFrame:
    """What a JPEG's headers say about how its pixels are coded (read before the first scan)."""

    marker: int  # the SOF marker's second byte, 0xC0 (SOF0) .. 0xCF (SOF15)
    precision: int  # bits per sample: 8, 12 or 16
    width: int
    height: int
    components: int
    component_ids: tuple[int, ...]
    adobe_transform: int | None  # APP14 "Adobe" colour transform: 0 none (RGB or CMYK), 1 YCbCr, 2 YCCK

    @property
    def sof(self) -> str:
        return f"SOF{self.marker - 0xC0}"

    def describe(self) -> str:
        """e.g. '16-bit lossless JPEG (SOF3, greyscale)', '8-bit JPEG (SOF0 baseline, YCCK)'."""
        colour = {1: "greyscale", 3: "colour", 4: "CMYK"}.get(self.components, f"{self.components} components")
        if self.components == 4 and self.adobe_transform == 2:
            colour = "YCCK"
        process = SOF_PROCESS.get(self.marker, "unknown-process")
        if self.marker in PORTABLE_SOF:
            return f"{self.precision}-bit JPEG ({self.sof} {process}, {colour})"
        return f"{self.precision}-bit {process} JPEG ({self.sof}, {colour})"

    def reencode_reason(self) -> str | None:
        """Why these pixels may not decode the same everywhere (the manifest's reason), or None."""
        if self.marker in LOSSLESS_SOF:
            return "lossless-jpeg"
        if self.marker in ARITHMETIC_SOF:
            return "arithmetic-jpeg"
        if self.marker not in PORTABLE_SOF:
            return "hierarchical-jpeg" if self.marker in HIERARCHICAL_SOF else "unknown-jpeg"
        if self.precision != 8:
            return f"{self.precision}bit-jpeg"
        if self.components == 4:
            return "ycck-jpeg" if self.adobe_transform == 2 else "cmyk-jpeg"
        if self.components == 3 and (self.adobe_transform == 0 or self.component_ids == (82, 71, 66)):
            # RGB coded without the YCbCr transform: libjpeg honours the marker, nvImageCodec assumes YCbCr
            return "rgb-jpeg"
        if self.components not in (1, 3):
            return f"{self.components}-component-jpeg"
        return None


def read_jpeg_frame(data: bytes | memoryview) -> JpegFrame | None:
    """The frame header of a JPEG, or None when `data` is not a JPEG or ends before its frame header.
    Walks the marker segments from SOI to the first SOS; reads nothing of the entropy-coded data. `data`
    may be a memoryview (`shard-convert index` passes the tar's read buffer: no copy of the image)."""
    if data[:2] != b"\xff\xd8":
        return None
    pos, adobe_transform, end = 2, None, len(data)
    while pos + 4 <= end:
        prefix, marker, length = _MARKER.unpack_from(data, pos)
        if prefix != 0xFF:
            return None  # not at a marker: damaged
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # SOS or EOI before any frame header
            return None
        if length < 2 or pos + 2 + length > end:
            return None
        if marker == 0xEE:
            adobe_transform = _adobe_transform(data, pos, length, adobe_transform)
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and length >= 8:
            segment = bytes(data[pos + 4:pos + 2 + length])
            components = segment[5]
            ids = tuple(segment[6 + 3 * i] for i in range(components) if 6 + 3 * i < len(segment))
            return JpegFrame(marker, segment[0], int.from_bytes(segment[3:5], "big"),
                             int.from_bytes(segment[1:3], "big"), components, ids,
                             _adobe_after(data, pos + 2 + length, adobe_transform))
        pos += 2 + length
    return None


_MARKER = struct.Struct(">BBH")  # a marker segment's start: 0xFF, the marker, the length (itself included)


def _adobe_transform(data: bytes | memoryview, pos: int, length: int, found: int | None) -> int | None:
    """The colour transform of the APP14 segment at `pos` if it is Adobe's (else `found`)."""
    if length >= 14 and data[pos + 4:pos + 9] == b"Adobe":
        return data[pos + 15]
    return found


def _adobe_after(data: bytes | memoryview, pos: int, found: int | None) -> int | None:
    """An APP14 Adobe marker may also follow the frame header; look until the first scan."""
    if found is not None:
        return found
    end = len(data)
    while pos + 4 <= end:
        prefix, marker, length = _MARKER.unpack_from(data, pos)
        if prefix != 0xFF or marker in (0xDA, 0xD9):
            return None
        if marker == 0xEE and data[pos + 4:pos + 9] == b"Adobe" and min(pos + 2 + length, end) - pos >= 16:
            return data[pos + 15]  # (a segment cut short by the file's end counts while it holds the field)
        if length < 2:
            return None
        pos += 2 + length
    return None


def sniff_format(data: bytes) -> str | None:
    """The image format `data` claims by its magic number (None: no image format we know)."""
    if data[:2] == b"\xff\xd8":
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return "HEIF/AVIF"
    return next((name for magic, name in _SIGNATURES if data.startswith(magic)), None)


@dataclass
class EncodedImage:
    jpeg: bytes
    width: int
    height: int
    reencoded: str | None  # why it was re-encoded (e.g. "png", "cmyk-jpeg", "max_side"), None if passed through


class ImageError(Exception):
    """The file is not a decodable image; the message says why."""


@contextmanager
def pixel_limit(max_pixels: int):
    """PIL's decompression-bomb limit set to `max_pixels` for the duration, then restored: the limit is an
    option of the conversion, not a process-wide setting imposed on whoever imports dalifeed."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # above the limit PIL only warns (it raises at twice the limit): make that an error too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def decode_check(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Fully decode `data` (a header peek would miss truncation and corrupt scans) and return the image.
    Raises ImageError saying what the file is when it cannot be decoded."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    try:
        with pixel_limit(max_pixels):
            img = Image.open(io.BytesIO(data))
            img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image larger than --max-pixels {max_pixels}") from None
    except UnidentifiedImageError:
        raise ImageError(_unreadable(data, None)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(_unreadable(data, e)) from None
    if img.width < 1 or img.height < 1:
        raise ImageError(f"empty image ({img.width}x{img.height})")
    return img


def _unreadable(data: bytes, error: Exception | None) -> str:
    """Why PIL could not decode `data`: an encoding we do not support, a damaged image, or no image."""
    fmt = sniff_format(data)
    frame = read_jpeg_frame(data) if fmt == "JPEG" else None
    if frame is not None and frame.reencode_reason() is not None:
        return f"unsupported: {frame.describe()}"
    if fmt in _UNDECODABLE:
        return f"unsupported: {fmt} image (PIL cannot decode it; convert it to JPEG or PNG first)"
    if error is not None:
        return f"corrupt or truncated image: {error}"
    if fmt is not None:
        return f"corrupt or truncated image: PIL cannot read this {fmt} file's header"
    return "not an image (no known image format, PIL cannot identify it)"


def to_jpeg(data: bytes, quality: int, max_side: int | None, max_pixels: int = DEFAULT_MAX_PIXELS,
            apply_orientation=True) -> EncodedImage:
    """Decode-check `data`; return it unchanged when it is a JPEG every decoder reads alike, upright and
    within `max_side`; else re-encode it to an RGB JPEG (upright, shrunk so its long side is `max_side`).
    `apply_orientation=False` keeps an EXIF-rotated image in its stored pixel frame instead (dropping the
    tag, so no reader rotates it): what COCO annotations made on the stored frame need. It may also be a
    function (orientation, stored width, stored height) -> bool, asked only for an EXIF-rotated image."""
    img = decode_check(data, max_pixels)
    width, height = img.size
    too_big = max_side is not None and max(width, height) > max_side
    orientation = img.getexif().get(EXIF_ORIENTATION, 1)
    rotated = orientation not in (1, None)
    if rotated and callable(apply_orientation):
        apply_orientation = apply_orientation(orientation, width, height)
    fmt = (img.format or "unknown").lower()
    frame_reason = None
    if fmt == "jpeg":
        frame = read_jpeg_frame(data)
        frame_reason = frame.reencode_reason() if frame is not None else "unknown-jpeg"
        if frame_reason is None and not rotated and not too_big:
            return EncodedImage(data, width, height, None)

    if too_big:
        reason = "max_side"
    elif rotated:
        reason = "exif-orientation"
    else:
        reason = frame_reason or fmt
    rgb = _to_rgb(ImageOps.exif_transpose(img) if rotated and apply_orientation else img)
    if too_big:
        scale = max_side / max(rgb.width, rgb.height)
        size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
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
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 12/16-bit greyscale: scale to 8 bits, not clip
        return img.point(lambda v: v / 256 if img.mode != "I" else v).convert("L").convert("RGB")
    return img.convert("RGB")
