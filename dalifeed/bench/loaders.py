"""The loaders dali-bench races, all producing the same thing: a normalised float (B, 3, S, S) batch of
RandomResizedCrop + flip images (float32, or float16 with `fp16`) and int64 labels on the device the model
would use.

The torch baselines get the care the field gives them (timm's PrefetchLoader): workers = cores, uint8
collate (4x less to pickle and pin than float), pinned memory and normalisation on the GPU when there is
one, persistent workers, prefetching.

The augmentation is one `AugmentConfig` (dalifeed.pipelines.augment) that `race_loader` makes: the DALI
loaders get it through `make_loader`, the torch ones through `train_transform`, its torchvision twin. A new
augmentation goes into both, next to each other below.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from dalifeed.pipelines import make_loader
from dalifeed.pipelines.augment import IMAGENET_MEAN, AugmentConfig, torchvision_policy
from dalifeed.pipelines.dataset import ShardData, open_dataset
from dalifeed.pipelines.graphs import DEFAULT_HW_DECODER_LOAD
from dalifeed.s3 import is_s3_url

from .names import DALI_DEVICES, GPU_LOADERS, LOADERS, PEERS


def skip_reason(name: str, shards: Path | str, device_type: str) -> str | None:
    """Why loader `name` cannot run here (said in the log, left out of the report), or None. `device_type`:
    'cuda' when torch sees a GPU, else 'cpu'."""
    if name in GPU_LOADERS and device_type != "cuda":
        return "skipped (no GPU)"
    if name == "webdataset" and is_s3_url(shards):
        return "skipped (plain webdataset reads s3:// only through a pipe: command; not measured)"
    if name in PEERS and is_s3_url(shards):
        return "skipped (the peers convert and read a local shard folder; not measured)"
    return None


# -- the augmentation: torchvision's and DALI's from the same AugmentConfig -----------------------------

# RandomErasing on the baseline's uint8 images (it normalises on the device): the ImageNet mean in grey levels,
# which normalises to within 0.01 of the 0 the DALI graph erases to after normalising; the same work per image
ERASE_UINT8 = tuple(round(m * 255) for m in IMAGENET_MEAN)


def train_transform(augment: AugmentConfig):
    """What graphs.train_augment does, in torchvision, up to uint8 (TorchLoader normalises on the device):
    RandomResizedCrop + flip, then augment's policy and random erasing (torchvision's transforms.v2 on the PIL
    image, as torchvision's reference ClassificationPresetTrain applies them)."""
    import torchvision.transforms as T

    steps = [T.RandomResizedCrop(augment.image_size, scale=augment.crop_scale, ratio=augment.crop_ratio,
                                 antialias=True)]
    if augment.flip:
        steps.append(T.RandomHorizontalFlip())
    if augment.auto_augment:
        steps.append(torchvision_policy(augment))
    steps.append(T.PILToTensor())
    if augment.random_erase:
        import torchvision.transforms.v2 as v2

        steps.append(v2.RandomErasing(p=augment.random_erase, value=list(ERASE_UINT8)))
    return T.Compose(steps)


def dali_loader(dataset: ShardData, split: str, batch_size: int, threads: int, device: str,
                augment: AugmentConfig, fp16: bool, hw_decoder_load: float) -> Iterable:
    # the prefetch queue dali-train gets on `device` (dalifeed/defaults.py: 5 with mixed decoding, 2 where the
    # CPU decodes), so that dali-bench and gpu-check race the loader a training run uses
    return make_loader(dataset, split, batch_size, augment=augment, train=True, device=device, num_threads=threads,
                       fp16=fp16, hw_decoder_load=hw_decoder_load)


def opened(shards: Path | str | ShardData, cache_dir=None, cache_limit=None, task: str = "classify") -> ShardData:
    """The shards as a `ShardData`: the one dali-bench opened, or a folder opened here (a test, a script)."""
    if isinstance(shards, ShardData):
        return shards
    return open_dataset(shards, task=task, cache_dir=cache_dir, cache_limit=cache_limit)


# -- the torch side ------------------------------------------------------------------------------------

class Normalize:
    """uint8 (B, 3, H, W) on the host -> normalised float on `device`: the copy is 4x smaller than a float
    batch and the arithmetic runs on the GPU when there is one."""

    def __init__(self, device: torch.device, augment: AugmentConfig, fp16: bool = False):
        self.device, self.dtype = device, torch.float16 if fp16 else torch.float32
        self.mean = torch.tensor(augment.mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(augment.std, device=device).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        return images.to(self.dtype), labels.to(self.device, non_blocking=True)


class TorchLoader:
    """A DataLoader of uint8 batches plus the device-side normalisation."""

    def __init__(self, dataloader: torch.utils.data.DataLoader, device: torch.device, augment: AugmentConfig,
                 fp16: bool = False):
        self.dataloader, self.normalize = dataloader, Normalize(device, augment, fp16)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.dataloader:
            yield self.normalize(images, labels)


# what a loader of unknown read-ahead may hold ready: a DataLoader's default (2 workers x prefetch_factor 4)
DEFAULT_AHEAD = 8


def batches_ahead(loader) -> int:
    """How many batches `loader` can hold ready before it is asked for them: a DataLoader's workers x
    prefetch_factor, a DALI loader's prefetch queue. A timed window that began with them full would count
    them as made inside it (in a short window, such as the demo's, they can be most of what it counts), so the
    warm-up drains them first (`measure.time_loader`)."""
    inner = getattr(loader, "loader", loader)  # run.on_device's
    if isinstance(inner, TorchLoader):
        return inner.dataloader.num_workers * (inner.dataloader.prefetch_factor or 0)
    options = getattr(inner, "options", None)  # a DaliLoader's LoaderOptions (resolved)
    if options is not None and getattr(options, "prefetch_queue_depth", None):
        return options.prefetch_queue_depth
    return DEFAULT_AHEAD


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


def baseline_loader(imagefolder: Path, batch_size: int, workers: int, device: torch.device,
                    augment: AugmentConfig, fp16: bool = False) -> TorchLoader:
    """torchvision ImageFolder + DataLoader: PIL decodes every JPEG in full on the CPU."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(imagefolder), transform=train_transform(augment), loader=upright_rgb)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                         **dataloader_options(workers, device))
    return TorchLoader(loader, device, augment, fp16)


def webdataset_loader(shards: Path | ShardData, split: str, batch_size: int, workers: int, device: torch.device,
                      augment: AugmentConfig, fp16: bool = False) -> TorchLoader:
    """Plain webdataset over the same shards: sequential tar reads, PIL decode, same transform."""
    import webdataset as wds

    manifest = opened(shards).manifest
    urls = [manifest.shard_location(s) for s in manifest.split_info(split).shards]  # run_bench skips s3:// ones
    transform = train_transform(augment)
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, torch.tensor)
        .batched(batch_size, partial=False)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, **dataloader_options(workers, device))
    return TorchLoader(loader, device, augment, fp16)


def race_loader(name: str, *, imagefolder: Path, shards: Path | str | ShardData, split: str, batch_size: int,
                image_size: int, workers: int, device: torch.device, fp16: bool = False,
                hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, cache_dir=None, cache_limit=None,
                augment: AugmentConfig | None = None) -> Iterable:
    """Loader `name` of the race: RandomResizedCrop(image_size) + flip + normalise (AugmentConfig's ImageNet
    recipe), plus `augment`'s policy and random erasing when given (its image_size is this), float16 batches
    with `fp16`. `shards`: the `ShardData` dali-bench opened, or a folder (then opened here, with `cache_dir`
    and `cache_limit` for the DALI loaders' shard cache of s3:// shards)."""
    augment = replace(augment or AugmentConfig(), image_size=image_size)
    if name == "baseline":
        return baseline_loader(imagefolder, batch_size, workers, device, augment, fp16)
    if name == "webdataset":
        return webdataset_loader(shards, split, batch_size, workers, device, augment, fp16)
    if name in DALI_DEVICES:
        return dali_loader(opened(shards, cache_dir, cache_limit), split, batch_size, workers, DALI_DEVICES[name],
                           augment, fp16, hw_decoder_load)
    raise ValueError(f"unknown loader {name!r} (choose from {', '.join(LOADERS)})")
