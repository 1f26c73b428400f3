"""The names options choose among, without the modules that define what they name (those import DALI): a
command's `--help` and its option checks read them here."""

from __future__ import annotations

POLICIES = ("imagenet", "ra", "ta_wide")  # torchvision's reference names (--auto-augment)
DEVICES = ("cpu", "gpu", "hybrid")
