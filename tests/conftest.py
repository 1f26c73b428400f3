"""Shared fixtures: tiny, real ImageFolder trees written with PIL in tmp_path."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def jpeg_bytes(array: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def random_image(rng: np.random.Generator, size=(24, 20), label: int = 0) -> np.ndarray:
    """A smooth image whose mean colour depends on the label, so a model can learn it and a reader can be
    checked against it."""
    h, w = size
    base = np.array([(label * 70) % 256, (label * 130 + 60) % 256, (255 - label * 50) % 256], np.float32)
    noise = rng.normal(0, 12, (h, w, 3))
    return (base + noise).clip(0, 255).astype(np.uint8)


def write_imagefolder(root: Path, counts: dict[str, int], seed: int = 0, size=(24, 20)) -> Path:
    """`root/<class>/<class>_<i>.jpg` with `counts[class]` JPEGs each."""
    rng = np.random.default_rng(seed)
    for label, (name, n) in enumerate(sorted(counts.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (folder / f"{name}_{i:04d}.jpg").write_bytes(jpeg_bytes(random_image(rng, size, label)))
    return root


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    """Three classes, 1007 images in all (odd counts catch shard arithmetic off-by-ones)."""
    return write_imagefolder(tmp_path / "src", {"cat": 401, "dog": 333, "emu": 273})


@pytest.fixture
def small_imagefolder(tmp_path: Path) -> Path:
    return write_imagefolder(tmp_path / "small", {"a": 13, "b": 11, "c": 7})
