"""Conversion: datasets -> WebDataset shards + DALI indexes + manifest. See docs/format.md.

The names below are imported from their modules when first used, so that `import dalifeed.convert` (and any
`from dalifeed.convert.X import ...`, which runs this file first) does not load PIL, numpy and tqdm.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "CocoConfig": ".coco", "convert_coco": ".coco", "export_coco": ".coco",
    "ConvertConfig": ".imagefolder", "ConvertSummary": ".imagefolder", "UsageError": ".imagefolder",
    "convert_imagefolder": ".imagefolder",
    "ManifestError": "..format", "ShardInfo": "..format", "ShardManifest": "..format", "SplitInfo": "..format",
    "ConversionFailed": ".shards", "WorkerCrashed": ".shards",
    "VerifyReport": ".verify", "verify_shards": ".verify",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # once: later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
