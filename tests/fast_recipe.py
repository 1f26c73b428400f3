"""The recipe the training tests train with, as a TrainConfig or as dali-train options: ResNet-18 on 16 px
images in batches of 8, which learns the colour-coded classes of the tests' shards (45 train images: 5 steps
an epoch) in a few epochs, in seconds on a CPU.

Stable on any x86-64 CPU's kernels: batch 8 of ResNet-18 with BatchNorm on 45 images is too small and too
short for SGD at a classic learning rate (it diverged on AVX2 kernels and not on AVX-512), while AdamW at
1e-3 (0.032 per 256 images) with a one-epoch warm-up learns it the same way everywhere."""

from __future__ import annotations

from pathlib import Path

from dalifeed.train import TrainConfig

FAST = dict(model="resnet18", image_size=16, batch_size=8, optimizer="adamw", lr=0.032, warmup_epochs=1.0,
            weight_decay=5e-4, crop_scale=(0.5, 1.0), workers=2)


def fast_config(data: Path | str, out: Path | str, **overrides) -> TrainConfig:
    """FAST on `data` into `out`; `overrides` replace or add TrainConfig fields (epochs=2, width=8, ...)."""
    return TrainConfig(data=str(data), out=str(out), **{**FAST, **overrides})


def fast_args(**overrides) -> list[str]:
    """FAST as dali-train options (without --data and --out); `overrides` by TrainConfig field name, None
    leaving that option to its default."""
    args = []
    for name, value in {**FAST, **overrides}.items():
        if value is None:
            continue
        args += [f"--{name.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return args
