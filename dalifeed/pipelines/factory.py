"""The loader factories. `build_loader(dataset, options, augment)` is the one every command uses: an opened
`dataset.Dataset`, a `loader.LoaderOptions` (what to read and how) and a `graphs.AugmentConfig` (what to do
to each image), all three dataclasses a run prints and saves. `make_loader(...)` is the same in keywords,
for a notebook or a script: it opens the dataset (unless given one) and builds the two configs.

    from dalifeed.pipelines import AugmentConfig, LoaderOptions, build_loader, open_dataset
    data = open_dataset("/data/shards", splits=("train",))
    loader = build_loader(data, LoaderOptions("train", 256, rank=rank, world_size=world), AugmentConfig())
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from .dataset import Dataset, DatasetError, open_dataset
from .graphs import DEFAULT_HW_DECODER_LOAD, AugmentConfig
from .loader import DaliLoader, LoaderOptions, classification_loader, ready
from .mixing import ConcatLoader, MixedLoader, mixed_loader


def build_loader(dataset: Dataset, options: LoaderOptions, augment: AugmentConfig | None = None,
                 image_size: Callable[[int], int] | None = None) -> DaliLoader | MixedLoader | ConcatLoader:
    """Batches of `(images, labels)` of `options.split` of `dataset` for this rank (the epoch contract:
    loader.py's docstring; `augment` default: AugmentConfig(), ImageNet's RandomResizedCrop recipe at 224).
    One shard folder gives a `DaliLoader`; several, a `MixedLoader` for a training split and a
    `ConcatLoader` (each dataset in turn) otherwise (mixing.py). A detection dataset is
    `make_detection_loader`'s. `image_size`: epoch -> that epoch's image size, for progressive resizing
    (`resolution.ProgressiveResize(...).size`)."""
    if dataset.task == "detection":
        raise DatasetError(f"{dataset.described}: opened for detection: use make_detection_loader")
    options = ready(dataset, options)
    augment = augment or AugmentConfig()
    multilabel = dataset.task == "multilabel"
    if dataset.mixed:
        return mixed_loader(dataset, options,
                            lambda source, o, size: classification_loader(source, o, augment, image_size=size),
                            image_size)
    return classification_loader(dataset.sources[0], options, augment, multilabel, image_size)


def make_loader(shards_dir: str | os.PathLike | list | Dataset, split: str, batch_size: int, *, rank: int = 0,
                world_size: int = 1, seed: int = 0, device: str = "auto", image_size: int = 224,
                train: bool | None = None, crop_scale: tuple[float, float] = (0.08, 1.0), flip: bool = True,
                dtype: torch.dtype = torch.float32, channels_last: bool = False, num_threads: int | None = None,
                prefetch_queue_depth: int | None = None, initial_fill: int = 1024, device_id: int | None = None,
                checkpointing: bool = False, check: str = "size", multilabel: bool = False,
                hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, weights: list[float] | None = None,
                cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                augment: AugmentConfig | None = None,
                lanes: int | None = None) -> DaliLoader | MixedLoader | ConcatLoader:
    """`build_loader` in keywords: batches of split `split` of the shard folder `shards_dir` (a path, or
    s3://bucket/prefix: the tars are then fetched whole into the node's shard cache and DALI reads them there,
    docs/storage.md), of a list of them (mixed), or of a `Dataset` already opened, for this rank; see
    loader.py's docstring (`train=None`: the split trains if its name starts with "train").

    `device`: 'auto' (GPU when torch and DALI see one), 'gpu' (nvJPEG decode, GPU augmentation), 'hybrid' (CPU
    decode, GPU augmentation: for when the GPU's decoder is the bottleneck) or 'cpu'. `hw_decoder_load`:
    with 'gpu', the share of JPEGs given to the hardware decoder of A100/H100-class GPUs (the rest go to CUDA
    cores; ignored where there is none). `device_id` defaults to the current CUDA device (set it from
    LOCAL_RANK under torchrun). `dtype` float32 or float16; `channels_last` gives
    NHWC. `num_threads`: DALI threads of the pipeline; default: this rank's share of the CPUs the process
    may use, capped (`dalifeed.budget`: 6 with GPU decoding, 16 with CPU decoding).
    `prefetch_queue_depth`: batches DALI prepares ahead; default 5 with GPU decoding, 2 otherwise
    (`dalifeed.defaults`: NVIDIA's published configurations). `lanes`: pipelines sharing the rank's epoch and
    its `num_threads`, each handing out whole batches in turn (dalifeed/pipelines/lanes.py); default
    (`loader.default_lanes`) 2 for CPU training with 2 threads or more and a rank's epoch of 24 batches or
    more (two keep the cores busy where one pipeline leaves them idle), else 1.
    `checkpointing` enables DALI's checkpointing so that `state_dict()` can be taken mid-epoch (see
    loader.py's docstring). `multilabel` (COCO shards): labels are float multi-hot (B, num_classes) vectors
    of the categories each image holds, built in the DALI graph. `augment`: the whole AugmentConfig
    (policies, random erasing; docs/pipelines.md) instead of image_size, crop_scale, flip and
    hw_decoder_load; dtype and channels_last still decide the output.
    Giving `augment` with an image_size, crop_scale, flip or hw_decoder_load other than their defaults is
    refused (ValueError): one of the two would be ignored.

    Opening the data (`open_dataset`; refused with a `Dataset`, which was opened with its own): `check`, what
    is compared with the manifest before reading, 'size' (sizes and indexes: two stats and two small reads
    per shard) or 'sha256' (also hashes every byte of the split). A list of shard folders mixes them
    (`weights`: their proportions in every batch, default equal; `dalifeed.pipelines.mixing` says how
    epochs, classes and resume work then). `cache_dir`, `cache_limit` (s3:// only): the node's shard cache
    the tars are fetched into, whole, before DALI reads them (default: `shards/` in dalifeed's cache folder;
    limit in bytes or a size such as '20GB' (20 * 10^9) or '20GiB' (20 * 2^30), default 90% of the free
    space; see dalifeed/pipelines/shardcache.py and docs/storage.md).
    """
    if augment is not None:
        refuse_shadowed_options(image_size=image_size, crop_scale=tuple(crop_scale), flip=flip,
                                hw_decoder_load=hw_decoder_load)
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
    task = "multilabel" if multilabel else "classify"
    if isinstance(shards_dir, Dataset):
        refuse_opening_options(shards_dir, task, check=check, weights=weights, cache_dir=cache_dir,
                               cache_limit=cache_limit)
        dataset = shards_dir
    else:
        dataset = open_dataset(shards_dir, task=task, weights=weights, check=check, cache_dir=cache_dir,
                               cache_limit=cache_limit)
    options = LoaderOptions(split, batch_size, train, rank=rank, world_size=world_size, seed=seed, device=device,
                            device_id=device_id, num_threads=num_threads, prefetch_queue_depth=prefetch_queue_depth,
                            initial_fill=initial_fill, checkpointing=checkpointing, lanes=lanes)
    augment = replace(
        augment or AugmentConfig(image_size=image_size, crop_scale=tuple(crop_scale), flip=flip,
                                 hw_decoder_load=hw_decoder_load),
        fp16=dtype == torch.float16, channels_last=channels_last)
    return build_loader(dataset, options, augment)


def not_defaults(**given) -> list[str]:
    """`name=value` of each of make_loader's keyword options given a value other than its default."""
    defaults = inspect.signature(make_loader).parameters
    return [f"{name}={value!r}" for name, value in given.items()
            if value != (tuple(defaults[name].default) if name == "crop_scale" else defaults[name].default)]


def refuse_shadowed_options(**given) -> None:
    """make_loader's keyword options that `augment=` replaces, refused when they differ from their defaults:
    the AugmentConfig would silently win over them."""
    shadowed = not_defaults(**given)
    if shadowed:
        raise ValueError(f"{', '.join(shadowed)} with augment=: the AugmentConfig decides these; set them in it "
                         f"(dataclasses.replace(augment, ...))")


def refuse_opening_options(dataset: Dataset, task: str, **given) -> None:
    """make_loader's options that open a dataset, refused with one already opened when they differ from their
    defaults (`open_dataset` took its own), and a `multilabel` that is not the dataset's task."""
    ignored = not_defaults(**given)
    if ignored:
        raise ValueError(f"{', '.join(ignored)} with an opened Dataset: open_dataset took these; pass them to it")
    if dataset.task != task:
        raise ValueError(f"multilabel={task == 'multilabel'}: the dataset was opened for {dataset.task!r} "
                         f"(open_dataset(task=...))")
