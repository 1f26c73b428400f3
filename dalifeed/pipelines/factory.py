"""`make_loader`, the one door to a classification loader:

    from dalifeed.pipelines import AugmentConfig, make_loader
    loader = make_loader("/data/shards", "train", 256, augment=AugmentConfig(image_size=176), fp16=True)

Each rank reads its part of the split: the rank and world size are the launcher's (torchrun's, or an
initialized process group's) unless `rank=` and `world_size=` are given (ranks.py says the order).

`data` is a shard folder (a path or s3://bucket/prefix), a list of them (mixed, equal weights), or a `ShardData`
opened with `open_dataset` (weights, the shard cache, the check before reading, multi-label targets). The
keywords after `augment` and `size_schedule` are `LoaderOptions`' fields, so a run that keeps its options as a
`LoaderOptions` (printed and saved with it, as dali-train does) passes them as they are:
`make_loader(dataset, **asdict(options), augment=augment)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .augment import AugmentConfig
from .dataset import DatasetError, ShardData, open_dataset
from .loader import DaliLoader, LoaderOptions, classification_loader, ready
from .mixing import ConcatLoader, MixedLoader, mixed_loader


def make_loader(data: str | os.PathLike | list | ShardData, split: str, batch_size: int, *,
                augment: AugmentConfig | None = None, size_schedule: Callable[[int], int] | None = None,
                **options) -> DaliLoader | MixedLoader | ConcatLoader:
    """Batches of `(images, labels)` of split `split` of `data` for this rank (the epoch contract: loader.py's
    docstring; `train=None`: the split trains if its name starts with "train").

    `augment`: what is done to each image (default `AugmentConfig()`: ImageNet's RandomResizedCrop(224) + flip
    for training, Resize(256) + CenterCrop(224) for validation; policies, random erasing: docs/pipelines.md).
    `size_schedule`: epoch -> that epoch's image size, for progressive resizing (`ProgressiveResize(...).size`),
    instead of `augment.image_size` in every epoch. `options`: `LoaderOptions`' fields (rank, world_size,
    seed, device, device_id, num_threads, prefetch_queue_depth, initial_fill, checkpointing, lanes, fp16,
    channels_last, hw_decoder_load; its docstring says each), split and batch_size being these.

    `rank` and `world_size` (default None, given together or not at all): left out, they are an initialized
    `torch.distributed` process group's (`get_rank()`, `get_world_size()`), else torchrun's `RANK` and
    `WORLD_SIZE` (never `LOCAL_RANK`, the rank on the node), else those of a Slurm step started by `srun`
    without torchrun (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`: srun sets the step's task count, sbatch's batch
    script has only the allocation's `SLURM_NTASKS` with `SLURM_PROCID=0`), else rank 0 of 1. Given, they win
    over the environment; given values that disagree with an initialized process group raise ValueError, but
    for a data-parallel subgroup's (a `world_size` above 1 dividing the group's size; ranks.py).
    `loader.options.ranks_from` says which source won ("arguments", "process group", "environment
    (RANK/WORLD_SIZE)", "environment (SLURM_PROCID/SLURM_STEP_NUM_TASKS)" or "default").

    One shard folder gives a `DaliLoader`; several, a `MixedLoader` for a training split and a `ConcatLoader`
    (each dataset in turn) otherwise (mixing.py). A detection dataset is `make_detection_loader`'s."""
    options = LoaderOptions(split, batch_size, **options)  # an unknown or bad option before the data is opened
    dataset = data if isinstance(data, ShardData) else open_dataset(data)
    if dataset.task == "detection":
        raise DatasetError(f"{dataset.described}: opened for detection: use make_detection_loader")
    options = ready(dataset, options)
    augment = augment or AugmentConfig()
    multilabel = dataset.task == "multilabel"
    if dataset.mixed:
        return mixed_loader(dataset, options,
                            lambda source, o, sizes: classification_loader(source, o, augment, size_schedule=sizes),
                            size_schedule)
    return classification_loader(dataset.sources[0], options, augment, multilabel, size_schedule)
