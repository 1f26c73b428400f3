"""The ImageNet-like photo set `make bench` and `make gpu-check` measure on, and its shards."""

from __future__ import annotations

import shutil
from pathlib import Path

from dalifeed.bench.sample_data import make_photos_imagefolder
from dalifeed.convert import ConvertConfig, convert_imagefolder


def build_data(workdir: Path, per_class: int, workers: int | None = None) -> tuple[Path, Path]:
    """The ImageNet-like photo set in WORKDIR/photos and its shards in WORKDIR/photos-shards; `workers`
    processes write the photos (default one) and convert them (default: the converter's, every core)."""
    photos = make_photos_imagefolder(workdir / "photos", per_class=per_class, seed=0, workers=workers or 1)
    shards = workdir / "photos-shards"
    if shards.exists():
        shutil.rmtree(shards)
    # small shards so the webdataset baseline can spread them over its workers
    convert_imagefolder(ConvertConfig(src=photos, out=shards, samples_per_shard=64, progress=False,
                                      **({"workers": workers} if workers else {})))
    return photos, shards
