"""The loaders dali-bench races, all producing the same thing: a normalised float (B, 3, S, S) batch of
RandomResizedCrop + flip images (float32, or float16 with `fp16`) and int64 labels on the device the model
would use.

The torch baselines get the care the field gives them (timm's PrefetchLoader): workers = cores, uint8
collate (4x less to pickle and pin than float), pinned memory and normalisation on the GPU when there is
one, persistent workers, prefetching.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dalifeed.pipelines import IMAGENET_MEAN, IMAGENET_STD, make_loader
from dalifeed.pipelines.graphs import DEFAULT_HW_DECODER_LOAD, AugmentConfig
from dalifeed.shardfolder import open_shard_folder

LOADERS = ("baseline", "webdataset", "dali-cpu", "dali-hybrid", "dali-gpu")
GPU_LOADERS = ("dali-hybrid", "dali-gpu")  # skipped where there is no GPU
DALI_DEVICES = {"dali-cpu": "cpu", "dali-hybrid": "hybrid", "dali-gpu": "gpu"}


# RandomErasing on the baseline's uint8 images (it normalises on the device): the ImageNet mean in grey levels,
# which normalises to within 0.01 of the 0 the DALI graph erases to after normalising; the same work per image
ERASE_UINT8 = tuple(round(m * 255) for m in IMAGENET_MEAN)


def train_transform(image_size: int, augment: AugmentConfig | None = None):
    """RandomResizedCrop + flip (+ augment's policy and random erasing, torchvision's transforms.v2 on the PIL
    image, as torchvision's reference ClassificationPresetTrain applies them) -> uint8 CHW tensor."""
    import torchvision.transforms as T

    steps = [T.RandomResizedCrop(image_size, antialias=True), T.RandomHorizontalFlip()]
    if augment is not None and augment.auto_augment:
        steps.append(torchvision_policy(augment))
    steps.append(T.PILToTensor())
    if augment is not None and augment.random_erase:
        import torchvision.transforms.v2 as v2

        steps.append(v2.RandomErasing(p=augment.random_erase, value=list(ERASE_UINT8)))
    return T.Compose(steps)


def torchvision_policy(augment: AugmentConfig):
    """torchvision's transform for augment.auto_augment (nearest-neighbour sampling, fill 0: its defaults)."""
    import torchvision.transforms.v2 as v2

    if augment.auto_augment == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    if augment.auto_augment == "ra":
        return v2.RandAugment(num_ops=augment.ra_num_ops, magnitude=augment.ra_magnitude)
    return v2.TrivialAugmentWide()


class Normalize:
    """uint8 (B, 3, H, W) on the host -> normalised float on `device`: the copy is 4x smaller than a float
    batch and the arithmetic runs on the GPU when there is one."""

    def __init__(self, device: torch.device, fp16: bool = False):
        self.device, self.dtype = device, torch.float16 if fp16 else torch.float32
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        return images.to(self.dtype), labels.to(self.device, non_blocking=True)


class TorchLoader:
    """A DataLoader of uint8 batches plus the device-side normalisation."""

    def __init__(self, dataloader: torch.utils.data.DataLoader, device: torch.device, fp16: bool = False):
        self.dataloader, self.normalize = dataloader, Normalize(device, fp16)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.dataloader:
            yield self.normalize(images, labels)


def dataloader_options(workers: int, device: torch.device) -> dict:
    options = dict(num_workers=workers, pin_memory=device.type == "cuda")
    if workers > 0:
        options.update(persistent_workers=True, prefetch_factor=4)
    return options


def upright_rgb(path: str):
    """torchvision's PIL loader plus EXIF orientation, as DALI's decoders and shard-convert apply it: the
    baseline sees the same pixels as the shards hold."""
    from PIL import Image, ImageOps

    with open(path, "rb") as f:
        img = Image.open(f)
        return ImageOps.exif_transpose(img).convert("RGB")


def baseline_loader(imagefolder: Path, batch_size: int, image_size: int, workers: int, device: torch.device,
                    fp16: bool = False, augment: AugmentConfig | None = None) -> TorchLoader:
    """torchvision ImageFolder + DataLoader: PIL decodes every JPEG in full on the CPU."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(imagefolder), transform=train_transform(image_size, augment), loader=upright_rgb)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                         **dataloader_options(workers, device))
    return TorchLoader(loader, device, fp16)


def webdataset_loader(shards: Path, split: str, batch_size: int, image_size: int, workers: int,
                      device: torch.device, fp16: bool = False, augment: AugmentConfig | None = None) -> TorchLoader:
    """Plain webdataset over the same shards: sequential tar reads, PIL decode, same transform."""
    import webdataset as wds

    manifest = open_shard_folder(shards)
    urls = [manifest.shard_location(s) for s in manifest.split_info(split).shards]  # run_bench skips s3:// ones
    transform = train_transform(image_size, augment)
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, torch.tensor)
        .batched(batch_size, partial=False)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, **dataloader_options(workers, device))
    return TorchLoader(loader, device, fp16)


def dali_loader(shards: Path, split: str, batch_size: int, image_size: int, threads: int, device: str,
                fp16: bool = False, hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD,
                augment: AugmentConfig | None = None) -> Iterable:
    if augment is not None:
        augment = replace(augment, image_size=image_size, hw_decoder_load=hw_decoder_load)
    return make_loader(shards, split, batch_size, device=device, image_size=image_size, num_threads=threads,
                       train=True, prefetch_queue_depth=2, dtype=torch.float16 if fp16 else torch.float32,
                       hw_decoder_load=hw_decoder_load, augment=augment)


def build_loader(name: str, *, imagefolder: Path, shards: Path, split: str, batch_size: int, image_size: int,
                 workers: int, device: torch.device, fp16: bool = False,
                 hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, augment: AugmentConfig | None = None) -> Iterable:
    """`augment`: a policy and random erasing for every loader (its image_size and hw_decoder_load are these)."""
    if name == "baseline":
        return baseline_loader(imagefolder, batch_size, image_size, workers, device, fp16, augment)
    if name == "webdataset":
        return webdataset_loader(shards, split, batch_size, image_size, workers, device, fp16, augment)
    if name in DALI_DEVICES:
        return dali_loader(shards, split, batch_size, image_size, workers, DALI_DEVICES[name], fp16, hw_decoder_load,
                           augment)
    raise ValueError(f"unknown loader {name!r} (choose from {', '.join(LOADERS)})")
