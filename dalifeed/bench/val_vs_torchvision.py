"""How far dalifeed's validation batches are from torchvision's on real photos (docs/pipelines.md):

    python -m dalifeed.bench.val_vs_torchvision --workdir build/val-check --per-class 25

Builds the ImageNet-like photo set (`make_photos_imagefolder`: 8 photos x `--per-class` views, 500x375 and
375x500 JPEGs), converts it with `shard-convert`, then compares the validation loader on the CPU
(`make_loader(..., train=False, device="cpu")`) over every split with torchvision's
`Resize(int(size / 0.875)) + CenterCrop(size) + ToTensor() + Normalize(mean, std)` on the same JPEG bytes.
Prints JSON: the mean absolute difference over all pixels, in normalised units, and the largest per-image mean.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import click
import torch

from dalifeed.format import ShardManifest
from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD


def torchvision_val_transform(image_size: int):
    import torchvision.transforms as T

    return T.Compose([T.Resize(int(image_size / 0.875)), T.CenterCrop(image_size), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def source_images(shards: Path, split: str) -> list:
    """The PIL images of `split`, decoded from the JPEG bytes in the shards, in the order the validation loader
    reads them (shard-convert stores the source files' bytes unchanged unless it had to re-encode them)."""
    import webdataset as wds
    from PIL import Image

    manifest = ShardManifest.load(shards)
    urls = [str(p) for p in manifest.shard_paths(split)]
    return [Image.open(io.BytesIO(s["jpg"])).convert("RGB") for s in wds.WebDataset(urls, shardshuffle=False)]


def per_image_difference(shards: Path, split: str, image_size: int = 224, batch_size: int = 16) -> torch.Tensor:
    """Mean absolute difference (normalised units) between dalifeed's and torchvision's validation output,
    one value per image of `split`."""
    reference = torchvision_val_transform(image_size)
    expected = torch.stack([reference(image) for image in source_images(shards, split)])
    loader = make_loader(shards, split, batch_size, augment=AugmentConfig(image_size=image_size), train=False,
                         device="cpu")
    images = torch.cat([images for images, _ in loader])
    if images.shape != expected.shape:
        raise RuntimeError(f"{split}: dalifeed gave {tuple(images.shape)}, torchvision {tuple(expected.shape)}")
    return (images - expected).abs().flatten(1).mean(1)


def measure(workdir: Path, per_class: int, image_size: int = 224) -> dict:
    from dalifeed.bench.sample_data import make_photos_imagefolder
    from dalifeed.convert import ConvertConfig, convert_imagefolder

    photos = make_photos_imagefolder(workdir / "photos", per_class=per_class)  # rewritten on every run
    convert_imagefolder(ConvertConfig(src=photos, out=workdir / "shards", overwrite=True, progress=False))
    splits = sorted(ShardManifest.load(workdir / "shards").splits)
    diffs = torch.cat([per_image_difference(workdir / "shards", split, image_size) for split in splits])
    return {"images": len(diffs), "image_size": image_size, "mean_abs_difference": round(float(diffs.mean()), 4),
            "max_image_mean_abs_difference": round(float(diffs.max()), 4)}


@click.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("build/val-check"),
              show_default=True)
@click.option("--per-class", default=25, show_default=True, help="Views per photo (8 photos).")
@click.option("--image-size", default=224, show_default=True)
def main(workdir: Path, per_class: int, image_size: int) -> None:
    """Validation batches against torchvision's Resize + CenterCrop + Normalize on real photos (JSON)."""
    click.echo(json.dumps(measure(workdir, per_class, image_size)))


if __name__ == "__main__":
    main()
