"""Conversion: datasets -> WebDataset shards + DALI indexes + manifest. See docs/format.md."""

from .coco import CocoConfig, convert_coco, export_coco
from .imagefolder import ConvertConfig, ConvertSummary, UsageError, convert_imagefolder
from ..format import ManifestError, ShardInfo, ShardManifest, SplitInfo
from .shards import ConversionFailed, WorkerCrashed
from .verify import VerifyReport, verify_shards

__all__ = [
    "CocoConfig", "ConvertConfig", "ConvertSummary", "UsageError", "convert_coco", "convert_imagefolder",
    "export_coco", "ManifestError", "ShardInfo",
    "ShardManifest", "SplitInfo", "ConversionFailed", "WorkerCrashed", "VerifyReport", "verify_shards",
]
