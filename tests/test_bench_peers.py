"""The peers dali-bench races (SPDL, Mosaic streaming, LitData) on tiny real data: each one's writer and loader,
when its package (the `peers` extra) is installed; `make test` never needs them."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dalifeed.bench.cli import main as bench_cli
from dalifeed.bench.peers import PEERS, missing_package, peer_loader
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig

MEAN_255, STD_255 = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))
COUNTS = {"a": 13, "b": 11, "c": 9}  # 33 photos: 8 batches of 4 and one photo the epoch drops


def class_colours(labels: torch.Tensor) -> torch.Tensor:
    """The mean RGB colour helpers.random_image gives each class, one row per label."""
    return torch.stack([(labels * 70) % 256, (labels * 130 + 60) % 256, (255 - labels * 50) % 256], 1).float()


def skip_without(name: str) -> None:
    """Skip unless peer `name` runs here (its package installed; for SPDL also FFmpeg's libraries)."""
    problem = missing_package(name)
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def peer_data(make_shards):
    return make_shards(COUNTS, size=(40, 52), samples_per_shard=8)


@pytest.mark.parametrize("augment", [None, AugmentConfig(auto_augment="ta_wide", random_erase=0.25)],
                         ids=["plain", "ta_wide+erase"])
@pytest.mark.parametrize("name", PEERS)
def test_peer_yields_normalised_batches_with_every_label_right(peer_data, tmp_path, name, augment):
    skip_without(name)
    _, shards = peer_data
    loader = peer_loader(name, shards=shards, split="train", batch_size=4, image_size=24, workers=2,
                         device=torch.device("cpu"), workdir=tmp_path, augment=augment)
    batches = list(loader)  # one epoch
    assert len(batches) == sum(COUNTS.values()) // 4
    for images, labels in batches:
        assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32
        assert labels.shape == (4,) and labels.dtype == torch.int64
        if augment is None:
            # normalised with ImageNet's statistics: undone, each image's channel means are its own class's
            # colour (7 of 255 measured); raw [0, 1] or [0, 255] floats, or another image's label, are off by tens
            pixels = images * STD_255 + MEAN_255
            assert (pixels.mean((2, 3)) - class_colours(labels)).abs().max() < 12
        else:  # the policy moves colours: still normalised grey levels, not [0, 1] or [0, 255]
            assert -2.2 < images.min() and images.max() < 2.7 and images.min() < -0.5
    labels = torch.cat([labels for _, labels in batches])
    counts = torch.bincount(labels, minlength=3).tolist()
    # one epoch of shuffled samples, each at most once: at most one photo missing (the partial batch dropped)
    assert all(0 <= n - got <= 1 for n, got in zip(COUNTS.values(), counts)) and sum(counts) == 32


@pytest.mark.parametrize("name", ["streaming", "litdata"])
def test_native_copy_is_written_once_and_reused(peer_data, tmp_path, name):
    skip_without(name)
    _, shards = peer_data
    build = dict(shards=shards, split="train", batch_size=4, image_size=24, workers=1, device=torch.device("cpu"),
                 workdir=tmp_path)
    next(iter(peer_loader(name, **build)))
    (copy,) = (tmp_path / "peers").iterdir()
    assert copy.name.startswith(f"{name}-train-")
    written = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file()}
    next(iter(peer_loader(name, **build)))
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file()} == written


def test_a_missing_peer_package_is_one_line_exit_2(peer_data, monkeypatch, tmp_path):
    """Without the extra, dali-bench names what to install instead of failing mid-race with a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "litdata", None)  # import litdata now raises ImportError
    assert missing_package("litdata") == ("--loaders litdata needs litdata, which is not installed: "
                                          "pip install 'dalifeed[peers]'")
    _, shards = peer_data
    result = CliRunner().invoke(bench_cli, ["--shards", str(shards), "--loaders", "dali-cpu,litdata",
                                            "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].endswith("pip install 'dalifeed[peers]'")
