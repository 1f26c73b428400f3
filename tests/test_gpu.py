"""The GPU paths: nvJPEG decoding (`device="mixed"`) and GPU operators. Skipped without a CUDA GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalifeed.pipelines import make_loader, resolve_device
from dalifeed.tools import ConvertConfig, convert_imagefolder

from conftest import write_imagefolder

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gpu")
    write_imagefolder(tmp / "src", {"a": 40, "b": 33, "c": 27}, size=(96, 128))
    convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "shards", samples_per_shard=32, progress=False))
    return tmp / "shards"


def test_auto_picks_the_gpu():
    assert resolve_device("auto") == "gpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_training_batches_live_on_the_gpu(shards, dtype):
    loader = make_loader(shards, "train", 16, image_size=64, dtype=dtype, device="gpu")
    images, labels = next(iter(loader))
    assert images.is_cuda and labels.is_cuda
    assert images.shape == (16, 3, 64, 64) and images.dtype == dtype and labels.dtype == torch.int64
    assert len(list(loader)) == len(loader) == 100 // 16


def test_gpu_validation_matches_the_cpu_pipeline(shards):
    """nvJPEG and libjpeg-turbo round differently; the images must still agree closely, labels exactly."""
    gpu = [(x.cpu(), y.cpu()) for x, y in make_loader(shards, "train", 25, train=False, image_size=64, device="gpu")]
    cpu = list(make_loader(shards, "train", 25, train=False, image_size=64, device="cpu"))
    for (xg, yg), (xc, yc) in zip(gpu, cpu):
        assert torch.equal(yg, yc)
        assert (xg - xc).abs().mean() < 0.02


def test_dali_gpu_loader_in_the_bench(shards):
    from dalifeed.bench.loaders import build_loader

    loader = build_loader("dali-gpu", imagefolder=shards, shards=shards, split="train", batch_size=8, image_size=32,
                          workers=2, device=torch.device("cuda"))
    images, _ = next(iter(loader))
    assert images.is_cuda and images.shape == (8, 3, 32, 32)
