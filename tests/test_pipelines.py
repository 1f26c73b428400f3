"""DALI graphs on the CPU against torchvision's reference transforms, on real shards."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from dalifeed.format import ManifestError
from dalifeed.pipelines import AugmentConfig, DatasetError, make_loader
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD
from helpers import convert


def photo_like(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth gradients and blobs: like a photo, interpolation differences stay small, as they do on real data."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    channels = []
    for _ in range(3):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(w / 6, w / 2)
        blob = 120 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        channels.append(60 + blob + x * rng.uniform(-0.5, 0.5) + y * rng.uniform(-0.5, 0.5))
    return np.stack(channels, -1).clip(0, 255).astype(np.uint8)


def write_jpegs(root: Path, classes: dict[str, list[np.ndarray]]) -> Path:
    for name, images in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            Image.fromarray(img).save(root / name / f"{i:03d}.jpg", quality=95)
    return root


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    sizes = [(48, 64), (64, 48), (50, 50), (61, 83)]
    src = write_jpegs(tmp / "src", {f"c{k}": [photo_like(rng, *sizes[(k + i) % 4]) for i in range(3)]
                                    for k in range(4)})
    convert(src, tmp / "shards", samples_per_shard=5)
    return tmp / "shards"


@pytest.fixture(scope="module")
def flat_shards(tmp_path_factory) -> tuple[Path, list[tuple[int, int, int]]]:
    """One constant-colour image per class: any crop, resize or flip leaves the colour, so the expected
    normalised value of every pixel is known exactly."""
    tmp = tmp_path_factory.mktemp("flat")
    colours = [(200, 30, 90), (10, 240, 120), (128, 128, 128), (250, 250, 5), (40, 60, 220)]
    src = write_jpegs(tmp / "src", {f"k{i}": [np.full((40, 56, 3), c, np.uint8)] * 3 for i, c in enumerate(colours)})
    convert(src, tmp / "shards")
    return tmp / "shards", colours


def read_source(shards: Path):
    """(decoded PIL image, label) pairs straight from the source files, in manifest order."""
    import json

    import webdataset as wds

    from dalifeed.convert import ShardManifest

    manifest = ShardManifest.load(shards)
    out = []
    for split in ("train",):
        for s in wds.WebDataset([str(p) for p in manifest.shard_paths(split)], shardshuffle=False):
            out.append((Image.open(io.BytesIO(s["jpg"])).convert("RGB"), json.loads(s["json"])["label"]))
    return out


# Real photos (scikit-image's) at sizes that exercise every rounding rule of the validation geometry at
# image_size 35 (torchvision: Resize(40) + CenterCrop(35)): crop margins (resized side - 35) of 5, 15, 16, 18,
# 19, 20, 21 and 22, every remainder mod 4 on both axes (torchvision rounds a half-pixel offset to even, DALI's
# crop_pos 0.5 up: 5 and 21 differ); longer sides where int() and round() differ (48x61 -> 40x50, DALI's
# resize_shorter gives 40x51; 61x48, 45x58, 33x47); landscape, portrait, square, upscaled and unresized images.
VAL_PHOTO_SHAPES = [(60, 80), (80, 60), (48, 61), (61, 48), (45, 58), (50, 50), (40, 57), (33, 47), (61, 83), (55, 40),
                    (47, 34)]
VAL_IMAGE_SIZE = 35


@pytest.fixture(scope="module")
def real_photo_shards(tmp_path_factory) -> Path:
    import skimage.data

    tmp = tmp_path_factory.mktemp("real")
    photos = [skimage.data.astronaut(), skimage.data.chelsea(), skimage.data.coffee(), skimage.data.rocket()]
    views = [np.asarray(Image.fromarray(photos[i % len(photos)]).resize((w, h), Image.LANCZOS))
             for i, (h, w) in enumerate(VAL_PHOTO_SHAPES)]
    src = write_jpegs(tmp / "src", {"a": views[0::2], "b": views[1::2]})
    convert(src, tmp / "shards")
    return tmp / "shards"


def centre_crop_shifted(image: Image.Image, size: int, dy: int, dx: int) -> torch.Tensor:
    """torchvision's validation transform with the crop moved by (dy, dx) pixels: what an off-by-one looks like."""
    import torchvision.transforms.functional as F

    resized = F.resize(image, int(size / 0.875))
    top = int(round((resized.height - size) / 2.0)) + dy
    left = int(round((resized.width - size) / 2.0)) + dx
    return F.normalize(F.to_tensor(F.crop(resized, top, left, size, size)), IMAGENET_MEAN, IMAGENET_STD)


@pytest.mark.parametrize("device", ["cpu", pytest.param("hybrid", marks=pytest.mark.gpu),
                                    pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.kernels
def test_validation_matches_torchvision_resize_centercrop_normalize(real_photo_shards, device):
    """Pixel geometry as torchvision's: output size of the resize, offset of the centre crop, filter width. What
    is left is resampling arithmetic: measured <= 0.0035 per image on the CPU under every kernel family, 10x
    below the smallest one-pixel shift of the crop on these photos (0.037)."""
    size = VAL_IMAGE_SIZE
    reference = T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.ToTensor(),
                           T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    source = read_source(real_photo_shards)
    expected = torch.stack([reference(img) for img, _ in source])
    expected_labels = torch.tensor([label for _, label in source])

    loader = make_loader(real_photo_shards, "train", 4, augment=AugmentConfig(image_size=size), train=False,
                         device=device)
    images, labels = (torch.cat(x).cpu() for x in zip(*loader))
    assert images.shape == expected.shape == (len(VAL_PHOTO_SHAPES), 3, size, size)
    assert torch.equal(labels, expected_labels)
    per_image = (images - expected).abs().flatten(1).mean(1)
    # nvJPEG decodes a little differently from libjpeg-turbo (PIL's and DALI's CPU decoder): more room on "gpu"
    tolerance = 0.025 if device == "gpu" else 0.01
    one_pixel_off = torch.tensor([min(float((centre_crop_shifted(img, size, dy, dx) - e).abs().mean())
                                      for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)))
                                  for (img, _), e in zip(source, expected)])
    assert (one_pixel_off > tolerance).all(), one_pixel_off  # the photos tell a shifted crop apart
    assert (per_image < tolerance).all(), per_image


@pytest.mark.kernels
def test_the_documented_measurement_runs_and_agrees(tmp_path):
    """`python -m dalifeed.bench.val_vs_torchvision` (docs/pipelines.md) on 24 of the 500x375 photos."""
    from dalifeed.bench.val_vs_torchvision import measure

    result = measure(tmp_path, per_class=3)
    assert result["images"] == 24 and result["image_size"] == 224
    assert result["max_image_mean_abs_difference"] < 0.01, result  # docs: 0.0030 on 200 photos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_training_output_shape_dtype_layout_and_exact_colour(flat_shards, dtype, channels_last):
    shards, colours = flat_shards
    loader = make_loader(shards, "train", 5, augment=AugmentConfig(image_size=24), channels_last=channels_last,
                         device="cpu", fp16=dtype == torch.float16)
    assert len(loader) == 3 and loader.num_samples == 15
    seen = 0
    for images, labels in loader:
        assert images.shape == (5, 3, 24, 24) and images.dtype == dtype
        assert labels.dtype == torch.int64 and labels.shape == (5,)
        assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        for image, label in zip(images.float(), labels):
            colour = torch.tensor(colours[int(label)], dtype=torch.float32)
            expected = (colour / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
            per_channel = image.mean(dim=(1, 2))
            assert torch.allclose(per_channel, expected, atol=0.04), (label, per_channel, expected)
            assert image.std(dim=(1, 2)).max() < 0.05  # flat stays flat: no padding, no border artefacts
        seen += len(labels)
    assert seen == 15


def test_training_crops_vary_and_cover_the_scale_range(photo_shards):
    loader = make_loader(photo_shards, "train", 4,
                         augment=AugmentConfig(image_size=32, crop_scale=(0.08, 1.0), flip=False), device="cpu", seed=3)
    first = torch.cat([images for images, _ in loader])
    second = torch.cat([images for images, _ in loader])
    assert first.shape == (12, 3, 32, 32)
    assert -2.2 < float(first.min()) and float(first.max()) < 2.7  # within ImageNet-normalised [0, 255]
    assert not torch.allclose(first, second)  # new crops every epoch


@pytest.fixture(scope="module")
def gradient_shards(tmp_path_factory) -> Path:
    """Images dark on the left, bright on the right: every crop keeps that, only a flip reverses it."""
    tmp = tmp_path_factory.mktemp("gradient")
    ramp = np.repeat(np.repeat(np.linspace(20, 235, 64)[None, :, None], 48, 0), 3, 2).astype(np.uint8)
    src = write_jpegs(tmp / "src", {"a": [ramp] * 7, "b": [ramp] * 5})
    convert(src, tmp / "shards")
    return tmp / "shards"


@pytest.mark.parametrize("flip", [False, True])
def test_flip_is_random_and_can_be_disabled(gradient_shards, flip):
    loader = make_loader(gradient_shards, "train", 4, augment=AugmentConfig(image_size=16, flip=flip), device="cpu")
    images = torch.cat([images for _ in range(3) for images, _ in loader])
    left_brighter = (images[..., :8].mean(dim=(1, 2, 3)) > images[..., 8:].mean(dim=(1, 2, 3))).sum()
    if flip:
        assert 0 < left_brighter < len(images)  # 36 coin flips
    else:
        assert left_brighter == 0


def test_bad_arguments_are_clear(photo_shards, tmp_path):
    with pytest.raises(ValueError, match="device must be"):
        make_loader(photo_shards, "train", 4, device="tpu")
    with pytest.raises(DatasetError, match=r"batch 64 is more than the \d+ samples of split 'train' each of 1 "):
        make_loader(photo_shards, "train", 64, device="cpu")
    with pytest.raises(DatasetError, match=r"^split test: .* has no such split \(has: train\)$"):
        make_loader(photo_shards, "test", 4, device="cpu")
    with pytest.raises(ManifestError, match=r"manifest\.json: missing \(not a dalifeed shard folder"):
        make_loader(tmp_path, "train", 4, device="cpu")
    with pytest.raises(ValueError, match="crop_scale"):
        make_loader(photo_shards, "train", 4, augment=AugmentConfig(crop_scale=(0.5, 0.1)), device="cpu")


@pytest.mark.parametrize("shape", [(375, 500), (40, 30)])  # shrinking (antialiasing matters) and enlarging
def test_training_resize_is_pils_bilinear(shape):
    """The square resize of the training crop filters as torchvision's RandomResizedCrop does on PIL images
    (BILINEAR, antialiased when shrinking): an unfiltered linear resize of a real photo to 64 px is ~5 grey
    levels away, PIL's own filter within 1."""
    import skimage.data
    from nvidia.dali import fn, pipeline_def

    from dalifeed.pipelines.augment import AugmentConfig
    from dalifeed.pipelines.graphs import resize_square

    photo = np.asarray(Image.fromarray(skimage.data.chelsea()).resize(shape[::-1], Image.LANCZOS))

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def resize_only():
        images = fn.external_source(source=lambda: [photo], batch=True, layout="HWC")
        return resize_square(images, AugmentConfig(image_size=64))

    pipe = resize_only()
    pipe.build()
    ours = np.asarray(pipe.run()[0][0]).astype(np.float32)
    pil = np.asarray(Image.fromarray(photo).resize((64, 64), Image.BILINEAR)).astype(np.float32)
    assert np.abs(ours - pil).mean() < 1.0


def signature_line(function) -> str:
    """`name(a, *, b=1, ...)` as docs/pipelines.md writes a signature."""
    import inspect

    parts, star = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        default = "" if p.default is p.empty else "=" + (
            "torch.float32" if p.default is torch.float32 else repr(p.default).replace("'", '"'))
        parts.append(p.name + default if p.kind is not p.VAR_KEYWORD else p.name)
    return f"{function.__name__}({', '.join(parts)})"


@pytest.mark.parametrize("name, first", [("make_loader", r"data, split, batch_size, \*"), ("open_dataset", "data")])
def test_docs_state_the_factories_whole_signatures(name, first):
    """docs/pipelines.md's make_loader and open_dataset lines are the code's signatures, every parameter and
    default."""
    import re

    import dalifeed.pipelines

    doc = (Path(__file__).parents[1] / "docs" / "pipelines.md").read_text()
    quoted = re.search(rf"`({name}\({first}.*?\))`", doc, re.S)
    assert quoted and " ".join(quoted[1].split()) == signature_line(getattr(dalifeed.pipelines, name))


def test_make_loader_takes_the_augmentation_in_one_place():
    """One name, one meaning: the image size is the AugmentConfig's, not also a loader keyword (no rule
    needed to say which of two wins)."""
    with pytest.raises(TypeError, match="image_size"):
        make_loader("unused", "train", 4, image_size=64)
