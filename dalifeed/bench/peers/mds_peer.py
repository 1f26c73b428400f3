"""Mosaic streaming: the split as MDS shards (MDSWriter), read by StreamingDataset + torch DataLoader."""

from __future__ import annotations

from pathlib import Path

import torch
from streaming import MDSWriter, StreamingDataset

from dalifeed.pipelines.augment import AugmentConfig

from ..loaders import TorchLoader, dataloader_options
from . import PilTransform, native_folder, photos, write_once


def write_mds(shards: Path, split: str, workdir: Path) -> Path:
    """The split as MDS shards: uncompressed (JPEGs do not compress), 64 MB shards (MDSWriter's default), the
    JPEG bytes as they are in a `bytes` column (its `jpeg` column re-encodes bytes it has no file name for)."""

    def write(tmp: Path) -> None:
        with MDSWriter(out=str(tmp), columns={"jpg": "bytes", "cls": "int"}, compression=None) as writer:
            for data, label in photos(shards, split):
                writer.write({"jpg": data, "cls": label})

    return write_once(native_folder(workdir, "streaming", shards, split), write)


class MdsPhotos(StreamingDataset):
    """StreamingDataset with the transform applied per sample, the way Mosaic's own vision datasets
    (streaming.vision.base.StreamingVisionDataset) subclass it."""

    def __init__(self, *, transform: PilTransform, **kwargs):
        super().__init__(**kwargs)
        self.transform = transform

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        sample = super().__getitem__(index)
        return self.transform(sample["jpg"]), int(sample["cls"])


def streaming_loader(folder: Path, batch_size: int, workers: int, device: torch.device,
                     augment: AugmentConfig, fp16: bool = False) -> TorchLoader:
    # the local folder read in place (no remote: nothing to download); batch_size given to the dataset as well,
    # as its docs ask, so that it partitions the samples per batch across workers
    dataset = MdsPhotos(local=str(folder), shuffle=True, batch_size=batch_size, transform=PilTransform(augment))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, drop_last=True,
                                         **dataloader_options(workers, device))
    return TorchLoader(loader, device, augment, fp16)
