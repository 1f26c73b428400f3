"""What a run counts: an epoch's statistics (`EpochStats`) and what moves between epochs and into checkpoints
(`TrainState`). Plain records, below the loop (loop.py) and its progress display (progress.py), which both
use them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochStats:
    loss: float = 0.0  # the sum over the steps taken while the epoch runs, their mean once it ends
    images: int = 0
    seconds: float = 0.0
    data_wait: float = 0.0
    bad_steps: int = 0
    steps: int = 0  # optimizer steps (taken or skipped)


@dataclass
class TrainState:
    """What moves between epochs and into checkpoints besides the modules."""

    epoch: int = 0  # the next epoch to run
    step: int = 0  # optimizer steps taken
    best_score: float = -1.0  # the best `epoch_score` so far: what best.pt holds
    bad_streak: int = 0

    @classmethod
    def from_checkpoint(cls, saved: dict) -> TrainState:
        """A checkpoint's "state"; checkpoints written before the score had its name called it best_top1."""
        saved = dict(saved)
        if "best_top1" in saved:
            saved["best_score"] = saved.pop("best_top1")
        return cls(**saved)
