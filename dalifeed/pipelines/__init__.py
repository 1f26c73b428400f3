"""DALI pipelines over dalifeed shards, and the PyTorch loader built on them.

    from dalifeed.pipelines import AugmentConfig, LoaderOptions, build_loader, open_dataset
    data = open_dataset("/data/shards", splits=("train",))  # once: opened, kind and splits checked
    loader = build_loader(data, LoaderOptions("train", 256, rank=rank, world_size=world), AugmentConfig())
    for images, labels in loader: ...

or in keywords: `make_loader("/data/shards", "train", batch_size=256, rank=rank, world_size=world)`.

Names are imported on first use, so that `dalifeed.pipelines.checks` (what `shard-convert verify
--decode` needs) and `dalifeed.pipelines.graphs` load without torch.
"""

from __future__ import annotations

from dalifeed.lazy import lazy_names

_WHERE = {
    "AugmentConfig": ".graphs", "IMAGENET_MEAN": ".graphs", "IMAGENET_STD": ".graphs", "normalize": ".graphs",
    "read_shards": ".graphs", "shard_pipeline": ".graphs", "train_augment": ".graphs", "val_transform": ".graphs",
    "DaliLoader": ".loader", "LoaderOptions": ".loader", "resolve_device": ".loader",
    "build_loader": ".factory", "make_loader": ".factory",
    "Dataset": ".dataset", "DatasetError": ".dataset", "MixError": ".dataset", "open_dataset": ".dataset",
    "EpochCursor": ".cursor", "ProgressiveResize": ".resolution",
    "ShardDataError": ".checks",
    "DetectionConfig": ".detection", "detection_pipeline": ".detection",
    "make_detection_loader": ".detection",
    "ThreadBudget": "..budget", "thread_budget": "..budget",
    "MixedLoader": ".mixing", "ConcatLoader": ".mixing",
}
__all__ = list(_WHERE)


_lent, __dir__ = lazy_names(__name__, _WHERE)


def __getattr__(name: str):
    try:
        return _lent(name)
    except ImportError as e:  # the API's first use of DALI where it does not import: the install, named
        from dalifeed.stack import dali_missing, is_dali_missing

        if not is_dali_missing(e):
            raise
        raise ImportError(f"dalifeed.pipelines.{name} needs NVIDIA DALI: {dali_missing(e)}") from e
