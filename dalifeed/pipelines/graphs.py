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

from dalifeed.format import CLASS_I64_MEMBER, COCO_LABELS_MEMBER, IMAGE_MEMBER

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Share of JPEGs `mixed` decoding gives the hardware JPEG decoder of A100/H100-class GPUs (DALI's default; the
# rest decode on CUDA cores). The best value depends on the GPU and on the cores feeding it: make gpu-check
# measures 0, 0.65 and 0.99.
DEFAULT_HW_DECODER_LOAD = 0.65

# nvJPEG sizing hints for ImageNet-like data (most images < 4 Mpx): allocate once, not per batch.
DEVICE_MEMORY_PADDING = 211025920
HOST_MEMORY_PADDING = 140544512
PREALLOCATE_WIDTH_HINT = 5980
PREALLOCATE_HEIGHT_HINT = 6430


@dataclass(frozen=True)
class AugmentConfig:
    """What the graphs do to an image. Defaults are the ImageNet recipe."""

    image_size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop(scale=...)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # RandomResizedCrop(ratio=...)
    flip: bool = True
    val_crop_fraction: float = 0.875  # resize the shorter side to image_size / 0.875, then centre crop
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    fp16: bool = False
    channels_last: bool = False
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if not 0 <= self.hw_decoder_load <= 1:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {self.hw_decoder_load}")

    @property
    def val_resize(self) -> int:
        return int(self.image_size / self.val_crop_fraction)


DEVICES = ("cpu", "gpu", "hybrid")


def decoder_device(device: str) -> str:
    return "mixed" if device == "gpu" else "cpu"


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
                initial_fill: int, multilabel: bool = False):
    """(jpegs, labels) from webdataset shards; labels are the int64 `.cls.i64` members, shape (1,) (ImageFolder
    shards), or with `multilabel` the int32 `.labels.i32` of COCO shards, shape (N,)."""
    label_member, label_type = (COCO_LABELS_MEMBER, types.INT32) if multilabel else (CLASS_I64_MEMBER, types.INT64)
    jpegs, labels = read_members(paths, index_paths, {IMAGE_MEMBER: types.UINT8, label_member: label_type},
                                 shard_id=shard_id, num_shards=num_shards, shuffle=shuffle, initial_fill=initial_fill)
    return jpegs, labels


def train_augment(jpegs, cfg: AugmentConfig, device: str):
    """RandomResizedCrop + RandomHorizontalFlip + Normalize."""
    images = resize_square(after_decode(decode_random_crop(jpegs, cfg, device), device), cfg)
    mirror = fn.random.coin_flip(probability=0.5) if cfg.flip else 0
    return normalize(images, cfg, mirror=mirror)


def decode_random_crop(jpegs, cfg: AugmentConfig, device: str):
    """The RandomResizedCrop window is drawn before decoding, so only the region kept is decoded (ROI
    decode): less work than decoding the whole image and cropping after."""
    gpu_hints = {}
    if device == "gpu":
        gpu_hints = dict(
            hw_decoder_load=cfg.hw_decoder_load, device_memory_padding=DEVICE_MEMORY_PADDING,
            host_memory_padding=HOST_MEMORY_PADDING, preallocate_width_hint=PREALLOCATE_WIDTH_HINT,
            preallocate_height_hint=PREALLOCATE_HEIGHT_HINT,
        )
    return fn.decoders.image_random_crop(
        jpegs, device=decoder_device(device), output_type=types.RGB, random_area=list(cfg.crop_scale),
        random_aspect_ratio=list(cfg.crop_ratio), num_attempts=10, adjust_orientation=ADJUST_ORIENTATION,
        **gpu_hints,
    )


def resize_square(images, cfg: AugmentConfig):
    # A triangle filter widened by the scale factor is what PIL's BILINEAR does (torchvision's default on
    # PIL images): linear when upscaling, antialiased when downscaling, and 30% cheaper on the CPU than
    # DALI's linear + separate antialias pass.
    return fn.resize(images, resize_x=cfg.image_size, resize_y=cfg.image_size,
                     interp_type=types.INTERP_TRIANGULAR, antialias=False)


def val_transform(jpegs, cfg: AugmentConfig, device: str):
    """Resize(shorter side = image_size / 0.875) + CenterCrop(image_size) + Normalize, as torchvision."""
    images = fn.decoders.image(jpegs, device=decoder_device(device), output_type=types.RGB,
                               adjust_orientation=ADJUST_ORIENTATION)
    images = fn.resize(after_decode(images, device), resize_shorter=cfg.val_resize,
                       interp_type=types.INTERP_TRIANGULAR, antialias=False)
    return normalize(images, cfg, crop=(cfg.image_size, cfg.image_size))


def normalize(images, cfg: AugmentConfig, mirror=0, crop=None):
    """(x / 255 - mean) / std in the output dtype and layout, fused with the crop and flip."""
    crop_args = {"crop": crop, "crop_pos_x": 0.5, "crop_pos_y": 0.5} if crop else {}
    return fn.crop_mirror_normalize(
        images, dtype=types.FLOAT16 if cfg.fp16 else types.FLOAT,
        output_layout="HWC" if cfg.channels_last else "CHW",
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


@pipeline_def(enable_conditionals=False)
def shard_pipeline(paths: list[str], index_paths: list[str], cfg: AugmentConfig, train: bool, device: str,
                   shard_id: int = 0, num_shards: int = 1, initial_fill: int = 1024, multilabel_classes: int = 0):
    """Reader -> train_augment or val_transform. Returns (images, labels): labels int64 (1,) per image, or
    with `multilabel_classes=K` (COCO shards) a float multi-hot (K,) built from the `.labels.i32` member."""
    jpegs, labels = read_shards(paths, index_paths, shard_id=shard_id, num_shards=num_shards, shuffle=train,
                                initial_fill=initial_fill, multilabel=bool(multilabel_classes))
    if multilabel_classes:
        labels = multi_hot(labels, multilabel_classes)
    images = train_augment(jpegs, cfg, device) if train else val_transform(jpegs, cfg, device)
    if uses_gpu(device):
        labels = labels.gpu()
    return images, labels
