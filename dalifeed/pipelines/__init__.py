"""DALI pipelines over dalifeed shards, and the PyTorch loaders built on them.

    from dalifeed.pipelines import AugmentConfig, make_loader
    loader = make_loader("/data/shards", "train", 256, augment=AugmentConfig(image_size=176))  # this rank's part
    for images, labels in loader: ...

`make_loader` is the one door (factory.py); `open_dataset` opens shard folders once with their options
(several mixed, a store's shard cache, multi-label targets), `LoaderOptions` are its keyword options as one
record (what dali-train prints and saves), `make_detection_loader` reads COCO shards for detection. The graphs,
the loader's parts and the rest are in their modules. Names are imported on first use, so that
`dalifeed.pipelines.checks` (what `shard-convert verify --decode` needs) and `dalifeed.pipelines.graphs` load
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dalifeed.lazy import lazy_names

_WHERE = {
    "make_loader": ".factory", "LoaderOptions": ".loader", "AugmentConfig": ".augment", "DaliLoader": ".loader",
    "open_dataset": ".dataset", "ShardData": ".dataset", "DatasetError": ".dataset", "ShardDataError": ".checks",
    "ProgressiveResize": ".resolution", "resolve_device": ".loader",
    "make_detection_loader": ".detection", "DetectionConfig": ".detection",
    "MixedLoader": ".mixing", "ConcatLoader": ".mixing",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:  # what IDEs and type checkers resolve the lent names to (the same modules as _WHERE)
    from .augment import AugmentConfig as AugmentConfig
    from .checks import ShardDataError as ShardDataError
    from .dataset import DatasetError as DatasetError
    from .dataset import ShardData as ShardData
    from .dataset import open_dataset as open_dataset
    from .detection import DetectionConfig as DetectionConfig
    from .detection import make_detection_loader as make_detection_loader
    from .factory import make_loader as make_loader
    from .loader import DaliLoader as DaliLoader
    from .loader import LoaderOptions as LoaderOptions
    from .loader import resolve_device as resolve_device
    from .mixing import ConcatLoader as ConcatLoader
    from .mixing import MixedLoader as MixedLoader
    from .resolution import ProgressiveResize as ProgressiveResize


_lent, __dir__ = lazy_names(__name__, _WHERE)


def __getattr__(name: str):
    try:
        return _lent(name)
    except ImportError as e:  # the API's first use of DALI where it does not import: the install, named
        from dalifeed.stack import dali_missing, is_dali_missing

        if not is_dali_missing(e):
            raise
        raise ImportError(f"dalifeed.pipelines.{name} needs NVIDIA DALI: {dali_missing(e)}") from e
