"""DALI pipelines over dalifeed shards, and the PyTorch loader built on them.

    from dalifeed.pipelines import make_loader
    loader = make_loader("/data/shards", "train", batch_size=256, rank=rank, world_size=world)
    for images, labels in loader: ...
"""

from .graphs import AugmentConfig, IMAGENET_MEAN, IMAGENET_STD, normalize, read_shards, shard_pipeline, \
    train_augment, val_transform
from .loader import DaliLoader, make_loader, resolve_device

__all__ = [
    "AugmentConfig", "IMAGENET_MEAN", "IMAGENET_STD", "normalize", "read_shards", "shard_pipeline", "train_augment",
    "val_transform", "DaliLoader", "make_loader", "resolve_device",
]
