"""The loaders dali-bench races, by name: what its options and their checks need, without the loaders (which
import torch and DALI)."""

from __future__ import annotations

LOADERS = ("baseline", "webdataset", "dali-cpu", "dali-hybrid", "dali-gpu")
GPU_LOADERS = ("dali-hybrid", "dali-gpu")  # skipped where there is no GPU
DALI_DEVICES = {"dali-cpu": "cpu", "dali-hybrid": "hybrid", "dali-gpu": "gpu"}
IMAGEFOLDER_LOADERS = ("baseline",)  # the loaders that read --imagefolder; the others read the shards
PEERS = ("spdl", "streaming", "litdata")  # the loaders a team would pick instead: bench/peers (the `peers` extra)
DETECTION_LOADERS = ("baseline", "dali-cpu", "dali-hybrid", "dali-gpu")
