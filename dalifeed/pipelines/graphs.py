"""DALI processing graphs as plain functions; `shard_pipeline` wires the webdataset reader to them.

The three devices differ only in device strings, never in the graph:

- `"gpu"`: decodes with nvJPEG (`"mixed"`: the A100/H100 hardware JPEG decoder takes `hw_decoder_load` of
  the images, CUDA cores the rest) and runs everything after it on the GPU;
- `"hybrid"`: decodes on the CPU (libjpeg-turbo), then crops, resizes and normalises on the GPU -- the mode
  NVIDIA's ResNet-50 example recommends when the GPU's decoder is the bottleneck or busy with other work;
- `"cpu"`: CPU operators only (no GPU needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali import math as dmath

from dalifeed.decode import DEFAULT_HW_DECODER_LOAD, decoder_device, decoder_hints
from dalifeed.format import CLASS_I64_MEMBER, COCO_LABELS_MEMBER, IMAGE_MEMBER

from . import augment
from .augment import AugmentConfig


@dataclass(frozen=True)
class Output:
    """How a graph decodes and hands out its images, beside what it does to them: float16 or float32, NHWC or
    NCHW, and the share of JPEGs `gpu` decoding gives the hardware decoder (a loader's options of those names)."""

    fp16: bool = False
    channels_last: bool = False
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD

    def __post_init__(self) -> None:
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {self.hw_decoder_load}")


def uses_gpu(device: str) -> bool:
    """Whether the graph's outputs live on the GPU (and the pipeline needs a device_id)."""
    return device in ("gpu", "hybrid")


def after_decode(images, device: str):
    """Where the operators after the decoder run: `hybrid` moves the decoded images to the GPU, the other
    devices keep them where the decoder put them."""
    return images.gpu() if device == "hybrid" else images


# EXIF orientation: shard-convert stores every image upright (re-encoding rotated ones), so shards carry no
# rotation tag and this changes nothing for them. For JPEGs from elsewhere it keeps DALI's default of
# showing the image as a person would see it, which is what dali-bench's baseline and verify do too.
ADJUST_ORIENTATION = True


def read_members(paths: list[str], index_paths: list[str], members: dict, *, shard_id: int, num_shards: int,
                 shuffle: bool, initial_fill: int):
    """The reader every dalifeed graph uses: the tar members `members` names (extension -> DALI type) of each
    sample, in that order. The loaders' epoch contract rests on its sharding arguments."""
    return fn.readers.webdataset(
        paths=paths, index_paths=index_paths, ext=list(members), dtypes=list(members.values()),
        missing_component_behavior="error", shard_id=shard_id, num_shards=num_shards,
        random_shuffle=shuffle, initial_fill=initial_fill, pad_last_batch=True, name="Reader",
        # DALI moves each rank to the next shard every epoch unless told to stick; the loader decides the
        # slice itself (a fresh pipeline per training epoch), so every pipeline keeps its own shard.
        stick_to_shard=True,
    )


def read_shards(paths: list[str], index_paths: list[str], *, shard_id: int, num_shards: int, shuffle: bool,
                initial_fill: int, multilabel: bool = False, text_label: dict | None = None):
    """(jpegs, labels) from webdataset shards; labels are the int64 `.cls.i64` members, shape (1,) (ImageFolder
    shards), or with `multilabel` the int32 `.labels.i32` of COCO shards, shape (N,), or with `text_label`
    (shards `shard-convert index` adopted: the manifest's `webdataset.label.dali`) ASCII text parsed to int64."""
    if text_label is not None:
        from .textlabels import text_labels

        jpegs, text = read_members(paths, index_paths, {IMAGE_MEMBER: types.UINT8, text_label["ext"]: types.UINT8},
                                   shard_id=shard_id, num_shards=num_shards, shuffle=shuffle,
                                   initial_fill=initial_fill)
        return jpegs, text_labels(text, text_label)
    label_member, label_type = (COCO_LABELS_MEMBER, types.INT32) if multilabel else (CLASS_I64_MEMBER, types.INT64)
    jpegs, labels = read_members(paths, index_paths, {IMAGE_MEMBER: types.UINT8, label_member: label_type},
                                 shard_id=shard_id, num_shards=num_shards, shuffle=shuffle, initial_fill=initial_fill)
    return jpegs, labels


def train_augment(jpegs, cfg: AugmentConfig, device: str, out: Output = Output()):
    """RandomResizedCrop + RandomHorizontalFlip + Normalize, with cfg.auto_augment's policy on the uint8
    images before the (fused) flip and normalisation and cfg.random_erase's erasing after it, in float32, before
    a float16 output is cast (augment.py)."""
    images = resize_square(after_decode(decode_random_crop(jpegs, cfg, device, out), device), cfg)
    if cfg.auto_augment:
        images = augment.apply_policy(images, cfg)
    mirror = fn.random.coin_flip(probability=0.5) if cfg.flip else 0
    if not cfg.random_erase:
        return normalize(images, cfg, out, mirror=mirror)
    # erasing writes torchvision's value=0 into the normalised image, in float32: DALI 2.4's GPU erase has no
    # float16 kernel (augment.ERASE_DTYPE), so a float16 output is cast after it (an exact 0 stays 0)
    images = augment.random_erase(normalize(images, cfg, out, mirror=mirror, dtype=augment.ERASE_DTYPE), cfg)
    return images if output_dtype(out) == augment.ERASE_DTYPE else fn.cast(images, dtype=output_dtype(out))


def needs_conditionals(cfg: AugmentConfig, train: bool) -> bool:
    """DALI's policies branch per sample (`if` in the graph): only their graphs pay for conditionals."""
    return train and cfg.auto_augment is not None


def decode_random_crop(jpegs, cfg: AugmentConfig, device: str, out: Output = Output()):
    """The RandomResizedCrop window is drawn before decoding, so only the region kept is decoded (ROI
    decode): less work than decoding the whole image and cropping after."""
    return fn.decoders.image_random_crop(
        jpegs, device=decoder_device(device), output_type=types.RGB, random_area=list(cfg.crop_scale),
        random_aspect_ratio=list(cfg.crop_ratio), num_attempts=10, adjust_orientation=ADJUST_ORIENTATION,
        **decoder_hints(device, out.hw_decoder_load, roi=True),
    )


# PIL's BILINEAR (torchvision's filter, antialiased when shrinking) is DALI's linear filter with `antialias=True`,
# close to PIL when shrinking, where INTERP_TRIANGULAR with antialias=False is far from it: bit for bit plain
# linear with no antialiasing (what the graphs used before, and why dali-cpu looked cheaper than a baseline that
# antialiases). Every resize in dalifeed's graphs uses this.
RESIZE_FILTER = {"interp_type": types.INTERP_LINEAR, "antialias": True}


def resize_square(images, cfg: AugmentConfig):
    return fn.resize(images, resize_x=cfg.image_size, resize_y=cfg.image_size, **RESIZE_FILTER)


def val_transform(jpegs, cfg: AugmentConfig, device: str, out: Output = Output()):
    """Resize(shorter side = cfg.val_shorter_side: image_size / 0.875 unless given) + CenterCrop(image_size)
    + Normalize, pixel for pixel where torchvision puts them: its output size and crop offset are computed
    here from each image's shape, because DALI rounds both differently (see `torchvision_resize_shape` and
    `torchvision_centre_crop_pos`)."""
    images = fn.decoders.image(jpegs, device=decoder_device(device), output_type=types.RGB,
                               adjust_orientation=ADJUST_ORIENTATION,
                               **decoder_hints(device, out.hw_decoder_load, roi=False))
    images = after_decode(images, device)
    height, width = torchvision_resize_shape(images, cfg.val_shorter_side)
    # RESIZE_FILTER: 0.15 grey levels from PIL on average for 500x375 photos resized to 256, against 0.8 without
    # antialiasing (same output sizes).
    images = fn.resize(images, resize_y=fn.cast(height, dtype=types.FLOAT), resize_x=fn.cast(width, dtype=types.FLOAT),
                       **RESIZE_FILTER)
    crop_pos = (torchvision_centre_crop_pos(height, cfg.image_size), torchvision_centre_crop_pos(width, cfg.image_size))
    return normalize(images, cfg, out, crop=(cfg.image_size, cfg.image_size), crop_pos=crop_pos)


def torchvision_resize_shape(images, shorter: int):
    """(height, width) per image (CPU integer nodes) of torchvision's `Resize(shorter)`: the shorter side
    `shorter`, the longer `int(shorter * long / short)`. DALI's `resize_shorter` rounds the longer side instead
    (375x500 -> 256x341 alike, 300x451 -> 256x385 where torchvision gives 256x384) and keeps the fractional
    scale, so explicit integer sizes are what make the two sample the same points."""
    shape = images.shape(device="cpu")  # (H, W, C) on the CPU, also for GPU images: argument inputs live there
    height, width = shape[0], shape[1]
    # `shorter * side // other side` is the floored size of the longer side, and at most `shorter` for the shorter
    return dmath.max(shorter, shorter * height // width), dmath.max(shorter, shorter * width // height)


def torchvision_centre_crop_pos(side, crop: int):
    """`crop_pos` (0..1) that makes crop_mirror_normalize start the crop at torchvision's CenterCrop offset,
    `int(round((side - crop) / 2))`: Python rounds halves to even (58.5 -> 58, 59.5 -> 60), DALI's crop_pos
    0.5 rounds them up (58.5 -> 59), a one-pixel shift whenever (side - crop) % 4 == 1. DALI computes
    `round(crop_pos * (side - crop))`, which gives back the exact integer offset passed in as a fraction."""
    margin = side - crop
    offset = margin // 2 + fn.cast(margin % 4 == 3, dtype=types.INT64)  # round half to even of margin / 2
    return fn.cast(offset, dtype=types.FLOAT) / fn.cast(dmath.max(margin, 1), dtype=types.FLOAT)


def output_dtype(out: Output):
    """The DALI type of the images a classification graph hands out."""
    return types.FLOAT16 if out.fp16 else types.FLOAT


def normalize(images, cfg: AugmentConfig, out: Output = Output(), mirror=0, crop=None, crop_pos=(0.5, 0.5),
              dtype=None):
    """(x / 255 - mean) / std in `dtype` (default: the output dtype) and the output layout, fused with the crop
    (`crop_pos`: (y, x) in 0..1) and flip."""
    crop_args = {"crop": crop, "crop_pos_y": crop_pos[0], "crop_pos_x": crop_pos[1]} if crop else {}
    return fn.crop_mirror_normalize(
        images, dtype=output_dtype(out) if dtype is None else dtype,
        output_layout="HWC" if out.channels_last else "CHW",
        mean=[m * 255 for m in cfg.mean], std=[s * 255 for s in cfg.std], mirror=mirror, **crop_args,
    )


def multi_hot(labels, num_classes: int):
    """(N,) class indices -> (num_classes,) float 0/1: which classes the image holds (none: all zeros)."""
    # `axis` given explicitly, although -1 is its default: without it, DALI's one_hot (CPU and GPU alike) treats
    # a batch in which every sample has exactly one element as a batch of scalars and returns (num_classes,)
    # instead of (1, num_classes), whatever the samples' shape, so a batch of single-label images failed in
    # the sum below. With it, (N,) -> (N, num_classes) for every N, 0 included; the sum over the N rows of
    # an empty image is all zeros.
    one_hot = fn.one_hot(labels, num_classes=num_classes, axis=-1, dtype=types.FLOAT)
    return fn.cast(fn.reductions.sum(one_hot, axes=[0]) > 0, dtype=types.FLOAT)


def shard_pipeline(paths: list[str], index_paths: list[str], cfg: AugmentConfig, train: bool, device: str,
                   out: Output = Output(), **kwargs):
    """Reader -> train_augment or val_transform. Returns (images, labels): labels int64 (1,) per image, or
    with `multilabel_classes=K` (COCO shards) a float multi-hot (K,) built from the `.labels.i32` member; with
    `sources=True` a third output, where each sample was read (`sample_sources`).
    `kwargs`: `shard_graph`'s and the Pipeline's (batch_size, num_threads, device_id, seed, ...)."""
    return shard_graph(paths, index_paths, cfg, train, device, out,
                       enable_conditionals=needs_conditionals(cfg, train), **kwargs)


@pipeline_def(enable_conditionals=False)
def shard_graph(paths: list[str], index_paths: list[str], cfg: AugmentConfig, train: bool, device: str,
                out: Output = Output(), shard_id: int = 0, num_shards: int = 1, initial_fill: int = 1024,
                multilabel_classes: int = 0, text_label: dict | None = None, sources: bool = False):
    """`shard_pipeline`'s graph (enable_conditionals is decided per call there)."""
    jpegs, labels = read_shards(paths, index_paths, shard_id=shard_id, num_shards=num_shards, shuffle=train,
                                initial_fill=initial_fill, multilabel=bool(multilabel_classes), text_label=text_label)
    if multilabel_classes:
        labels = multi_hot(labels, multilabel_classes)
    images = train_augment(jpegs, cfg, device, out) if train else val_transform(jpegs, cfg, device, out)
    if uses_gpu(device):
        labels = labels.gpu()
    if sources:  # made last: the operators before it keep the seeds they have without it
        return images, labels, sample_sources(jpegs)
    return images, labels


def sample_sources(jpegs):
    """Where each sample was read, as the reader says it (`source_info`: `TAR:OFFSET:MEMBER` for the webdataset
    reader), ASCII in uint8 zero-padded to the batch's longest: a dense CPU tensor the PyTorch iterator hands
    out beside the images (the loader records with it which samples it has handed out: elastic.py)."""
    return fn.pad(fn.get_property(jpegs, key="source_info"), axes=0, fill_value=0)
