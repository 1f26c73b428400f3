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
from typing import Any

from .augment import AugmentConfig
from .dataset import DatasetError, ShardData, open_dataset
from .loader import DaliLoader, LoaderOptions, classification_loader, ready
from .mixing import ConcatLoader, MixedLoader, mixed_loader


def make_loader(data: str | os.PathLike | list | ShardData, split: str, batch_size: int, *,
                augment: AugmentConfig | None = None, size_schedule: Callable[[int], int] | None = None,
                **options: Any) -> DaliLoader | MixedLoader | ConcatLoader:
    """The loader of one split for this rank: DALI reads the shards and hands out `(images, labels)` torch
    batches.

    The epoch contract a training loop can rely on: validation yields every sample of the split exactly
    once per epoch across all ranks, never padding; training yields exactly `len(loader)` full batches on
    every rank (a partial last batch is dropped), so no DDP rank waits on another; an epoch's order depends
    on `(seed, epoch)` alone and `set_epoch(e)` jumps to epoch e; `state_dict()` and `load_state_dict()`
    resume mid-epoch exactly (with `checkpointing=True`), on as many ranks or on others. Before a split is
    first read its shards are checked against the manifest, and bad data raises `ShardDataError` naming the
    tar.

    Args:
        data: A shard folder (a local path or `s3://bucket/prefix`), a list of them (mixed in equal shares),
            or a `ShardData` from `open_dataset` (mixing weights, the shard cache, `sha256` checks,
            multi-label targets).
        split: The split to read, e.g. `"train"` or `"val"`. Unless `train=` says otherwise, a split whose
            name starts with "train" is read for training (shuffled, augmented, full batches), any other for
            validation.
        batch_size: Samples per batch on each rank.
        augment: What is done to each image; None: `AugmentConfig()`, ImageNet's RandomResizedCrop(224) and
            flip for training, Resize(256) and CenterCrop(224) for validation. Default None.
        size_schedule: epoch -> that epoch's training image size in px, for progressive resizing (e.g.
            `ProgressiveResize.parse("160:192:65:76").size`); None: `augment.image_size` in every epoch.
            Default None.
        **options: `LoaderOptions`' fields other than `split` and `batch_size`, as keywords: `rank`,
            `world_size`, `seed`, `train`, `device`, `device_id`, `num_threads`, `prefetch_queue_depth`,
            `initial_fill`, `checkpointing`, `lanes`, `fp16`, `channels_last`, `hw_decoder_load`, `epochs`
            (each described there). A run that keeps a `LoaderOptions` passes `**asdict(options)` minus `split` and
            `batch_size`. `rank` and `world_size` (given together or not at all) default to the launcher's:
            an initialized `torch.distributed` process group's, else torchrun's `RANK` and `WORLD_SIZE` (never
            `LOCAL_RANK`, the rank on the node), else those of a Slurm step started by `srun` without torchrun
            (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`), else rank 0 of 1. Given, they win over the environment;
            given values must agree with an initialized process group, or be a data-parallel subgroup's (a
            `world_size` above 1 dividing the group's size). `loader.options.ranks_from` says which source won.

    Returns:
        One shard folder: a `DaliLoader`. Several: a `MixedLoader` for a training split (every batch drawn
        from each folder in its share) or a `ConcatLoader` for validation (each folder in turn). Each is an
        iterable of `(images, labels)` with `len()`, `num_samples` and `set_epoch()`: images are
        `(batch, 3, H, W)` normalised float32 (float16 with `fp16=True`) on the loader's device, labels
        int64 class indices (multi-hot float32 for `task="multilabel"` data).

    Raises:
        TypeError: An option `LoaderOptions` does not have.
        ValueError: A bad option value, or `rank`/`world_size` that disagree with an initialized process
            group.
        ManifestError: No finished shard folder at `data`.
        DatasetError: No such split, an empty one, a batch larger than a rank's share of the split, or data
            opened for detection (read it with `make_detection_loader`).
        ShardDataError: A shard disagrees with its manifest.

    Example:
        ```python
        from dalifeed.pipelines import AugmentConfig, make_loader

        # under torchrun each rank reads its part: the ranks are the launcher's
        loader = make_loader("/data/shards", "train", 256, augment=AugmentConfig(image_size=176))
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for images, labels in loader:
                ...
        ```
    """
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
