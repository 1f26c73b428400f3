"""LitData: the split as chunks written by litdata.optimize, read by StreamingDataset + StreamingDataLoader."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import litdata
import torch
from litdata import StreamingDataLoader, StreamingDataset

from dalifeed.pipelines.augment import AugmentConfig

from ..loaders import TorchLoader, dataloader_options
from . import native_folder, photos, tensor_transform, write_once


def write_litdata(shards: Path, split: str, workdir: Path, workers: int) -> Path:
    """The split as LitData chunks (litdata.optimize with `workers` processes, 64 MB chunks)."""

    def write(tmp: Path) -> None:
        # optimize sets the process's start method (spawn unless told) and leaves it so, which would turn every
        # later DataLoader of the race to spawned workers: fork (the photos are in memory), then put it back
        before = multiprocessing.get_start_method(allow_none=True)
        try:
            litdata.optimize(fn=litdata_sample, inputs=list(photos(shards, split)), output_dir=str(tmp),
                             chunk_bytes="64MB", num_workers=max(1, workers), mode="overwrite", start_method="fork",
                             verbose=False)
        finally:
            multiprocessing.set_start_method(before, force=True)

    return write_once(native_folder(workdir, "litdata", shards, split), write)


def litdata_sample(photo: tuple[bytes, int]) -> dict:
    data, label = photo
    # max_quality=None: the bytes as they are (its default re-encodes JPEGs it estimates above quality 95)
    return {"image": litdata.Jpeg(bytes=data, max_quality=None), "label": label}


class TensorSample:
    """LitData's decoded item {"image": uint8 (3, H, W), "label"} -> (augmented image, label)."""

    def __init__(self, augment: AugmentConfig):
        self.transform = tensor_transform(augment)

    def __call__(self, item: dict) -> tuple[torch.Tensor, int]:
        return self.transform(item["image"]), int(item["label"])


def litdata_loader(folder: Path, batch_size: int, workers: int, device: torch.device,
                   augment: AugmentConfig, fp16: bool = False) -> TorchLoader:
    # its serializer decodes each JPEG to a uint8 tensor (torchvision.io.decode_jpeg; PIL when it has EXIF)
    dataset = StreamingDataset(input_dir=str(folder), shuffle=True, drop_last=True, transform=TensorSample(augment))
    loader = StreamingDataLoader(dataset, batch_size=batch_size, drop_last=True,
                                 **dataloader_options(workers, device))
    return TorchLoader(loader, device, augment, fp16)
