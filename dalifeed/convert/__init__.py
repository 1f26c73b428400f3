"""Conversion: datasets -> WebDataset shards + DALI indexes + manifest. See docs/format.md.

The names below are imported from their modules when first used, so that `import dalifeed.convert` (and any
`from dalifeed.convert.X import ...`, which runs this file first) does not load PIL, numpy and tqdm.
"""

from __future__ import annotations

from dalifeed.lazy import lazy_names

_WHERE = {
    "CocoConfig": ".coco", "convert_coco": ".coco", "export_coco": ".coco",
    "ConvertConfig": ".imagefolder", "ConvertSummary": ".imagefolder", "UsageError": ".imagefolder",
    "convert_imagefolder": ".imagefolder",
    "ManifestError": "..format", "ShardInfo": "..format", "ShardManifest": "..format", "SplitInfo": "..format",
    "ConversionFailed": ".shards", "WorkerCrashed": ".shards",
    "VerifyReport": ".verify", "verify_shards": ".verify",
}

__all__ = list(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
