"""Shared fixtures: tiny, real ImageFolder trees written with PIL in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import jpeg_bytes, random_image, write_imagefolder  # noqa: F401  (older tests import them from here)


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


@pytest.fixture
def imagefolder(tmp_path: Path) -> Path:
    """Three classes, 1007 images in all (odd counts catch shard arithmetic off-by-ones)."""
    return write_imagefolder(tmp_path / "src", {"cat": 401, "dog": 333, "emu": 273})


@pytest.fixture
def small_imagefolder(tmp_path: Path) -> Path:
    return write_imagefolder(tmp_path / "small", {"a": 13, "b": 11, "c": 7})
