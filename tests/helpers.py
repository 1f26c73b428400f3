"""Builders of small, real test data (images, ImageFolder trees), imported by the tests."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

DATA = Path(__file__).parent / "data"


def jpeg_bytes(array: np.ndarray, quality: int = 90, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=quality, **options)
    return buf.getvalue()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def random_image(rng: np.random.Generator, size=(24, 20), label: int = 0) -> np.ndarray:
    """A smooth image whose mean colour depends on the label, so a model can learn it and a reader can be
    checked against it."""
    h, w = size
    base = np.array([(label * 70) % 256, (label * 130 + 60) % 256, (255 - label * 50) % 256], np.float32)
    noise = rng.normal(0, 12, (h, w, 3))
    return (base + noise).clip(0, 255).astype(np.uint8)


def gradient_image(h: int = 40, w: int = 48) -> np.ndarray:
    """A smooth colour gradient: every decoder agrees on it closely, and any flip or rotation shows."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), (x + y) * 255 // max(1, w + h - 2)],
                    -1).astype(np.uint8)


def write_imagefolder(root: Path, counts: dict[str, int], seed: int = 0, size=(24, 20)) -> Path:
    """`root/<class>/<class>_<i>.jpg` with `counts[class]` JPEGs each."""
    rng = np.random.default_rng(seed)
    for label, (name, n) in enumerate(sorted(counts.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (folder / f"{name}_{i:04d}.jpg").write_bytes(jpeg_bytes(random_image(rng, size, label)))
    return root
