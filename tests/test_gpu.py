"""The GPU paths: nvJPEG decoding (`device="mixed"`) and GPU operators. Skipped without a CUDA GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalifeed.pipelines import make_loader, resolve_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"a": 40, "b": 33, "c": 27}, size=(96, 128), samples_per_shard=32)[1]


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


def test_gpu_detection_loader_matches_the_cpu_boxes(tmp_path):
    """The detection graph with `mixed` decoding: validation boxes and labels equal the CPU graph's (the
    boxes do not depend on the decoder), images close, everything on the GPU."""
    from dalifeed.pipelines import make_detection_loader
    from dalifeed.tools.coco import CocoConfig, convert_coco
    from helpers import write_coco

    images, annotations = write_coco(tmp_path / "coco")
    out = tmp_path / "out"
    convert_coco(CocoConfig(images=[images], annotations=[annotations], out=out, progress=False, workers=1))
    gpu = list(make_detection_loader(out, "mini", 4, train=False, size=64, device="gpu"))
    cpu = list(make_detection_loader(out, "mini", 4, train=False, size=64, device="cpu"))
    for (gi, gt), (ci, ct) in zip(gpu, cpu):
        assert all(x.is_cuda for x in gi) and all(t["boxes"].is_cuda for t in gt)
        for a, b in zip(gt, ct):
            assert a["image_id"] == b["image_id"] and torch.equal(a["labels"].cpu(), b["labels"])
            torch.testing.assert_close(a["boxes"].cpu(), b["boxes"])
        for a, b in zip(gi, ci):
            assert (a.cpu() - b).abs().mean() < 0.05
    train = make_detection_loader(out, "mini", 4, train=True, size=64, device="gpu")
    batch_images, targets = next(iter(train))
    assert len(batch_images) == 4 and batch_images[0].shape == (3, 64, 64)
