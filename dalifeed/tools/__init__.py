"""Conversion: datasets -> WebDataset shards + DALI indexes + manifest. See docs/format.md."""

from .imagefolder import ConvertConfig, ConvertSummary, UsageError, convert_imagefolder
from ..format import ManifestError, ShardInfo, ShardManifest, SplitInfo
from .shards import ConversionFailed, WorkerCrashed
from .verify import VerifyReport, verify_shards

__all__ = [
    "ConvertConfig", "ConvertSummary", "UsageError", "convert_imagefolder", "ManifestError", "ShardInfo",
    "ShardManifest", "SplitInfo", "ConversionFailed", "WorkerCrashed", "VerifyReport", "verify_shards",
]
