"""DALI pipelines over dalifeed shards, and the PyTorch loader built on them.

    from dalifeed.pipelines import make_loader
    loader = make_loader("/data/shards", "train", batch_size=256, rank=rank, world_size=world)
    for images, labels in loader: ...

Names are imported on first use, so that `dalifeed.pipelines.checks` (what `shard-convert verify
--decode` needs) and `dalifeed.pipelines.graphs` load without torch.
"""

from __future__ import annotations

from dalifeed.lazy import lazy_names

_WHERE = {
    "AugmentConfig": ".graphs", "IMAGENET_MEAN": ".graphs", "IMAGENET_STD": ".graphs", "normalize": ".graphs",
    "read_shards": ".graphs", "shard_pipeline": ".graphs", "train_augment": ".graphs", "val_transform": ".graphs",
    "DaliLoader": ".loader", "LoaderOptions": ".loader", "make_loader": ".loader", "resolve_device": ".loader",
    "ShardDataError": ".checks",
    "DetectionConfig": ".detection", "detection_pipeline": ".detection",
    "make_detection_loader": ".detection",
    "ThreadBudget": "..budget", "thread_budget": "..budget",
    "MixedLoader": ".mixing", "MixError": ".mixing",
}
__all__ = list(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
