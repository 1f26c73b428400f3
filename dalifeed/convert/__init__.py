"""Conversion: datasets -> WebDataset shards + DALI indexes + manifest. See docs/format.md.

The names below are imported from their modules when first used, so that `import dalifeed.convert` (and any
`from dalifeed.convert.X import ...`, which runs this file first) does not load PIL, numpy and tqdm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dalifeed.lazy import lazy_names

_WHERE = {
    "CocoConfig": ".coco", "convert_coco": ".coco", "export_coco": ".coco",
    "ConvertConfig": ".imagefolder", "ConvertSummary": ".imagefolder", "UsageError": ".imagefolder",
    "convert_imagefolder": ".imagefolder",
    "TFRecordConfig": ".tfrecord", "convert_tfrecord": ".tfrecord",
    "ManifestError": "..format", "ShardInfo": "..format", "ShardManifest": "..format", "SplitInfo": "..format",
    "ConversionFailed": ".shards", "WorkerCrashed": ".shards",
    "VerifyReport": ".verify", "verify_shards": ".verify",
}

__all__ = list(_WHERE)

if TYPE_CHECKING:  # what IDEs and type checkers resolve the lent names to (the same modules as _WHERE)
    from dalifeed.format import ManifestError as ManifestError
    from dalifeed.format import ShardInfo as ShardInfo
    from dalifeed.format import ShardManifest as ShardManifest
    from dalifeed.format import SplitInfo as SplitInfo

    from .coco import CocoConfig as CocoConfig
    from .coco import convert_coco as convert_coco
    from .coco import export_coco as export_coco
    from .imagefolder import ConvertConfig as ConvertConfig
    from .imagefolder import ConvertSummary as ConvertSummary
    from .imagefolder import UsageError as UsageError
    from .imagefolder import convert_imagefolder as convert_imagefolder
    from .shards import ConversionFailed as ConversionFailed
    from .shards import WorkerCrashed as WorkerCrashed
    from .tfrecord import TFRecordConfig as TFRecordConfig
    from .tfrecord import convert_tfrecord as convert_tfrecord
    from .verify import VerifyReport as VerifyReport
    from .verify import verify_shards as verify_shards


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
