"""Detection: COCO shards -> DALI graph -> torchvision-style `(images, targets)` batches (docs/coco.md).

    from dalifeed.pipelines import make_detection_loader
    loader = make_detection_loader("/data/coco-shards", "train2017", batch_size=16)  # ranks: the launcher's
    for images, targets in loader:            # images: list of (3, H, W) float tensors
        losses = model(images, targets)       # targets: [{"boxes": (N, 4) xyxy pixels, "labels", "image_id"}]

The graph is SSD's: `fn.random_bbox_crop` draws a crop window that keeps boxes (IoU thresholds), the
window goes to `fn.decoders.image_slice` so only it is decoded, image and boxes are flipped together
(`fn.flip` + `fn.bb_flip`), resized and normalised. Boxes stay relative (0..1) inside DALI; the loader
scales them to the pixels of each output image. DALI pads the per-image box lists to the longest in the
batch; the loader trims them with the per-image counts. Same epoch contract as `make_loader`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from nvidia.dali import fn, pipeline_def, types

from dalifeed.decode import DEFAULT_HW_DECODER_LOAD, decoder_device, decoder_hints
from dalifeed.format import (
    COCO_BOXES_MEMBER,
    COCO_CROWD_BOXES_MEMBER,
    COCO_CROWD_LABELS_MEMBER,
    COCO_ID_MEMBER,
    COCO_LABELS_MEMBER,
    IMAGE_MEMBER,
)

from .augment import IMAGENET_MEAN, IMAGENET_STD
from .dataset import DatasetError, ShardData, open_dataset
from .graphs import ADJUST_ORIENTATION, RESIZE_FILTER, after_decode, read_members, uses_gpu
from .loader import DaliLoader, LoaderOptions, ready

# SSD's sampler (Liu et al. 2016, as DALI's SSD example and torchvision's RandomIoUCrop): minimum IoU of a
# kept box with the window, window scale and aspect ratio; 0 = any window; "no crop" is one of the choices.
IOU_THRESHOLDS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
CROP_SCALING = (0.3, 1.0)
CROP_ASPECT_RATIO = (0.5, 2.0)
DETECTION_OUTPUTS = ("images", "boxes", "labels", "counts", "ids", "sizes")


@dataclass(frozen=True)
class DetectionConfig:
    """What the detection graph does to an image and its boxes: a square output (`size`, like SSD) or the
    shorter side resized with the aspect kept (`min_size`/`max_size`, like torchvision's
    GeneralizedRCNNTransform); one of the two.

    Attributes:
        size: The side in px of the square output, at least 8; None with `min_size` given (neither given:
            512). Default None.
        min_size: Resize the shorter side to this many px, aspect kept; None: `size` is used. Default None.
        max_size: With `min_size`: the longer side at most this many px (the shorter then ends below
            `min_size`); None: no bound. Default None.
        crop: Training: a random crop that keeps boxes (SSD's), before the resize. Default True.
        flip: Training: a random horizontal flip of image and boxes. Default True.
        include_crowd: Also hand out COCO's `iscrowd` regions as targets; they are not instances, so they are
            left out by default. Default False.
        mean: Per-channel (R, G, B) mean subtracted after scaling pixels to [0, 1]. Default ImageNet's.
        std: Per-channel (R, G, B) standard deviation divided by after the mean. Default ImageNet's.

    Raises:
        ValueError: Both or neither of `size` and `min_size`, or a size out of range.
    """

    size: int | None = None
    min_size: int | None = None
    max_size: int | None = None
    crop: bool = True
    flip: bool = True
    include_crowd: bool = False
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.size is None and self.min_size is None:
            object.__setattr__(self, "size", 512)  # frozen: the default square size, set once
        if (self.size is None) == (self.min_size is None):
            raise ValueError("give either size (square output) or min_size (and max_size), not both or neither")
        if self.size is not None and self.size < 8:
            raise ValueError(f"size must be >= 8, got {self.size}")
        if self.max_size is not None and self.min_size is not None and self.max_size < self.min_size:
            raise ValueError(f"max_size {self.max_size} < min_size {self.min_size}")


def read_detection_shards(paths, index_paths, *, shard_id: int, num_shards: int, shuffle: bool, initial_fill: int,
                          include_crowd: bool):
    """(jpegs, boxes (N, 4) relative xyxy, labels (N,) int32, image ids (1,) int64)."""
    members = {IMAGE_MEMBER: types.UINT8, COCO_BOXES_MEMBER: types.FLOAT, COCO_LABELS_MEMBER: types.INT32,
               COCO_ID_MEMBER: types.INT64}
    if include_crowd:
        members |= {COCO_CROWD_BOXES_MEMBER: types.FLOAT, COCO_CROWD_LABELS_MEMBER: types.INT32}
    jpegs, boxes, labels, ids, *crowd = read_members(paths, index_paths, members, shard_id=shard_id,
                                                     num_shards=num_shards, shuffle=shuffle, initial_fill=initial_fill)
    boxes = fn.reshape(boxes, shape=[-1, 4])
    if include_crowd:
        boxes = fn.cat(boxes, fn.reshape(crowd[0], shape=[-1, 4]), axis=0)
        labels = fn.cat(labels, crowd[1], axis=0)
    return jpegs, boxes, labels, ids


def random_crop_and_flip(jpegs, boxes, labels, cfg: DetectionConfig, device: str,
                         hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD):
    """Decode only a window that keeps boxes, then flip image and boxes together. Also returns the window
    (anchor, shape, relative) and the flip flag, which tests use to check the boxes independently."""
    if cfg.crop:
        anchor, shape, boxes, labels = fn.random_bbox_crop(
            boxes, labels, device="cpu", aspect_ratio=list(CROP_ASPECT_RATIO), thresholds=list(IOU_THRESHOLDS),
            scaling=list(CROP_SCALING), bbox_layout="xyXY", allow_no_crop=True, num_attempts=50)
        images = fn.decoders.image_slice(jpegs, anchor, shape, device=decoder_device(device), output_type=types.RGB,
                                         adjust_orientation=ADJUST_ORIENTATION,
                                         **decoder_hints(device, hw_decoder_load, roi=True))
    else:
        anchor, shape = fn.constant(fdata=[0.0, 0.0]), fn.constant(fdata=[1.0, 1.0])
        images = fn.decoders.image(jpegs, device=decoder_device(device), output_type=types.RGB,
                                   adjust_orientation=ADJUST_ORIENTATION,
                                   **decoder_hints(device, hw_decoder_load, roi=False))
    images = after_decode(images, device)
    flip = fn.random.coin_flip(probability=0.5) if cfg.flip else fn.constant(idata=0)
    if cfg.flip:
        boxes = fn.bb_flip(boxes, ltrb=True, horizontal=flip)
        images = fn.flip(images, horizontal=flip)
    return images, boxes, labels, (anchor, shape, flip)


def resize_and_normalize(images, cfg: DetectionConfig):
    if cfg.size is not None:
        images = fn.resize(images, resize_x=cfg.size, resize_y=cfg.size, **RESIZE_FILTER)
    else:
        limit = {"max_size": cfg.max_size} if cfg.max_size else {}
        images = fn.resize(images, resize_shorter=cfg.min_size, **RESIZE_FILTER, **limit)
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                    mean=[m * 255 for m in cfg.mean], std=[s * 255 for s in cfg.std])


# exec_dynamic: `images.shape()` of a GPU node read on the CPU (below) is a GPU-to-CPU edge, which only
# DALI's dynamic executor runs; it is DALI 2.4's default only while exec_async and exec_pipelined are on.
@pipeline_def(enable_conditionals=False, exec_dynamic=True)
def detection_pipeline(paths: list[str], index_paths: list[str], cfg: DetectionConfig, train: bool, device: str,
                       shard_id: int = 0, num_shards: int = 1, initial_fill: int = 1024, debug: bool = False,
                       hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD):
    """Returns images (3, H, W) padded to the batch's largest, boxes (N, 4) relative xyxy padded with zeros,
    labels (N,) padded with -1, the box count, the image id and the image's (3, H, W) before padding; with
    `debug`, also the crop window (anchor, shape) and the flip flag. `hw_decoder_load`: the loader's option."""
    jpegs, boxes, labels, ids = read_detection_shards(
        paths, index_paths, shard_id=shard_id, num_shards=num_shards, shuffle=train, initial_fill=initial_fill,
        include_crowd=cfg.include_crowd)
    if train:
        images, boxes, labels, window = random_crop_and_flip(jpegs, boxes, labels, cfg, device, hw_decoder_load)
    else:
        images = after_decode(fn.decoders.image(jpegs, device=decoder_device(device), output_type=types.RGB,
                                                adjust_orientation=ADJUST_ORIENTATION,
                                                **decoder_hints(device, hw_decoder_load, roi=False)), device)
        window = None
    images = resize_and_normalize(images, cfg)
    sizes = images.shape()
    counts = labels.shape()
    images = fn.pad(images, axes=(1, 2), fill_value=0) if cfg.size is None else images
    boxes = fn.pad(boxes, axes=(0,), fill_value=0)
    labels = fn.pad(labels, axes=(0,), fill_value=-1)
    outputs = [images, boxes, labels, counts, ids, sizes]
    if uses_gpu(device):
        outputs[1:] = [x.gpu() for x in outputs[1:]]
    if debug:
        if window is None:
            window = (fn.constant(fdata=[0.0, 0.0]), fn.constant(fdata=[1.0, 1.0]), fn.constant(idata=0))
        outputs += list(window)
    return tuple(outputs)


def targets_from_batch(batch: dict) -> tuple[list[torch.Tensor], list[dict]]:
    """DALI's padded batch -> a list of images and torchvision detection targets, trimmed per image.

    On the GPU every read of a device value by Python (`int()`, `.item()`) waits for the GPU to finish all
    queued work: the sizes, box counts and ids the trimming needs come to the host in one small copy per
    batch, and the boxes are scaled to pixels for the whole batch in one kernel, on the device."""
    sizes = batch["sizes"]  # (B, 3): C, H, W of each image before padding
    host = torch.cat([sizes[:, 1:3], batch["counts"][:, :1], batch["ids"][:, :1]], dim=1).cpu().tolist()
    scale = sizes[:, [2, 1, 2, 1]].to(torch.float32)  # (B, 4): W, H, W, H
    boxes = batch["boxes"].float() * scale[:, None, :]  # relative xyxy -> pixels of each image
    labels = batch["labels"].long()
    images, targets = [], []
    for i, (height, width, n, image_id) in enumerate(host):
        images.append(batch["images"][i, :, :height, :width])
        targets.append({"boxes": boxes[i, :n], "labels": labels[i, :n], "image_id": image_id})
    return images, targets


def make_detection_loader(data: str | os.PathLike | ShardData, split: str, batch_size: int, *,
                          detection: DetectionConfig | None = None, **options: Any) -> DaliLoader:
    """The detection loader of one split of COCO shards for this rank: DALI reads, crops, flips and resizes
    images and boxes together and hands out batches for torchvision detection models.

    The epoch contract is `make_loader`'s: validation yields every sample once per epoch across all ranks,
    training exactly `len(loader)` full batches on every rank, an epoch's order depends on `(seed, epoch)`
    alone, and `state_dict()` resumes mid-epoch. Training crops (SSD's sampler) and flips; validation only
    resizes.

    Args:
        data: A COCO shard folder (a local path or `s3://bucket/prefix`), or a `ShardData` opened with
            `open_dataset(..., task="detection")` (its shard cache and check options).
        split: The split to read, e.g. `"train2017"`; a name starting with "train" is read for training
            unless `train=` says otherwise.
        batch_size: Images per batch on each rank.
        detection: The output size, the training crop and flip, crowd boxes; None: `DetectionConfig()`
            (square 512 px). Default None.
        **options: `LoaderOptions`' fields other than `split` and `batch_size`, as keywords (`rank`,
            `world_size`, `seed`, `train`, `device`, `num_threads`, `checkpointing`, `hw_decoder_load`, ...);
            `lanes` is always 1, and `fp16` and `channels_last` are refused. `rank` and `world_size` default
            to the launcher's as `make_loader`'s do (an initialized process group, else torchrun's
            `RANK`/`WORLD_SIZE`, else srun's step, else 0 of 1); `loader.options.ranks_from` says which.

    Returns:
        A `DaliLoader` yielding `(images, targets)`: `images` a list of normalised float32 (3, H, W) tensors,
        `targets` a list of `{"boxes": (N, 4) float32 x0 y0 x1 y1 in the image's pixels, "labels": (N,)
        int64, "image_id": the COCO image id, an int}`. Labels are contiguous category indices in the order
        of the manifest's `coco.category_ids`; for a model whose class 0 is background (torchvision's), add 1.

    Raises:
        DatasetError: Shards that are not COCO's, data opened for another task, no such split, or a batch
            larger than a rank's share.
        ValueError: `fp16` or `channels_last`, ranks that disagree with an initialized process group, or
            another bad option.
        ShardDataError: A shard disagrees with its manifest.

    Example:
        ```python
        from dalifeed.pipelines import DetectionConfig, make_detection_loader

        loader = make_detection_loader("/data/coco-shards", "train2017", 16, detection=DetectionConfig(size=640))
        for images, targets in loader:
            losses = model(images, targets)
        ```
    """
    if isinstance(data, ShardData):
        dataset = data
        if dataset.task != "detection":
            raise DatasetError(f"{dataset.described}: opened for {dataset.task!r}: open it with "
                               f"open_dataset(..., task='detection')")
    else:  # ShardManifest's kind is checked: detection needs COCO's boxes
        dataset = open_dataset(data, task="detection")
    detection = detection or DetectionConfig()
    # one lane: joining lanes' last batches would pad the labels with 0, where this graph pads them with -1
    options = ready(dataset, LoaderOptions(split, batch_size, **{**options, "lanes": 1}))
    if options.fp16 or options.channels_last:
        raise ValueError("fp16 and channels_last shape classification batches: detection hands out float32 (3, H, W) "
                         "images in lists")
    graph = partial(detection_pipeline, cfg=detection, hw_decoder_load=options.hw_decoder_load)
    return DaliLoader(dataset.sources[0], options, graph=graph, outputs=DETECTION_OUTPUTS, to_torch=targets_from_batch)
