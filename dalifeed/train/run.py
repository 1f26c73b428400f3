"""`Run`: everything a run holds once built (`trainer.build_run`), what `trainer.fit` drives and
`loop.train_one_epoch` trains with; at each epoch's end its metrics line and checkpoints (`finish_epoch`), in
the middle of one a mid-epoch checkpoint (`save_midway`), and what best.pt keeps the best of (`epoch_score`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dalifeed.runtime import DiskFull, free_bytes, mib

from . import checkpoint
from .config import TrainConfig
from .distributed import Dist, gather_objects, log
from .progress import RunLog
from .state import EpochStats, TrainState
from .stop import StepChecks, Stop


@dataclass
class Run:
    """Every rank trains, rank 0 writes."""

    cfg: TrainConfig
    dist: Dist
    model: torch.nn.Module  # unwrapped: what checkpoints hold
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_loader: object
    val_loader: object | None = None
    dtype: torch.dtype | None = None  # autocast's; None: full precision
    ema: torch.nn.Module | None = None
    classes: list[str] = field(default_factory=list)
    train_model: torch.nn.Module | None = None  # what trains: DDP and/or torch.compile around `model` (None: it)
    state: TrainState = field(default_factory=TrainState)
    run_log: RunLog | None = None
    profiler: object | None = None
    midway: dict | None = None  # the mid-epoch checkpoint this run resumes inside, until its epoch starts
    stop: Stop = field(default_factory=Stop)
    checks: StepChecks | None = None  # skipped steps tallied on the device, and when the host reads them

    def __post_init__(self):
        if self.train_model is None:
            self.train_model = self.model
        if self.checks is None:
            self.checks = StepChecks(self.dist.device)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_loader) // self.cfg.accum_steps  # an incomplete last window is dropped

    def start_epoch(self, epoch: int) -> EpochStats | None:
        """Point the loader at `epoch`, or at the rest of it when resuming mid-epoch (then returns the
        statistics of the part already run)."""
        if self.midway is None:
            self.train_loader.set_epoch(epoch)
            return None
        self.train_loader.load_state_dict(self.midway["loaders"][self.dist.rank])
        partial, self.midway = EpochStats(**self.midway["stats"]), None
        return partial

    def save_midway(self, stats: EpochStats) -> None:
        """A mid-epoch last.pt: the run, the epoch's statistics so far and every rank's reader position."""
        loaders = gather_objects(self.train_loader.state_dict())
        if self.dist.is_main:
            payload = self.payload(metrics=None)
            payload["midway"] = {"stats": asdict(stats), "loaders": loaders}
            self.save(self.out / checkpoint.LAST, payload)

    def finish_epoch(self, record: dict) -> None:
        """Rank 0: metrics line first, then last.pt (and best.pt); a crash between them only replays the epoch."""
        if not self.dist.is_main:
            return
        score = epoch_score(self.cfg, record)
        is_best = score > self.state.best_score
        self.state.best_score = max(self.state.best_score, score)
        self.run_log.write(record)
        log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
        payload = self.payload(metrics=record)
        self.save(self.out / checkpoint.LAST, payload)
        if is_best:
            self.save(self.out / checkpoint.BEST, payload)

    def payload(self, metrics: dict | None) -> dict:
        """Everything a resume needs: weights, optimiser, schedule, scaler, EMA, counters, RNG states, config,
        and the number of processes that trained (a resume on another number keeps the global batch)."""
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None, "state": asdict(self.state),
            "rng": checkpoint.rng_state(), "config": self.cfg.to_json(), "classes": self.classes,
            "metrics": metrics, "world_size": self.dist.world_size,
        }

    def save(self, path: Path, payload: dict) -> None:
        try:
            checkpoint.save(path, payload)
        except DiskFull as e:
            raise DiskFull(f"{e} (a checkpoint of this run takes about {mib(checkpoint.size_of(payload))}, "
                           f"{mib(free_bytes(path.parent))} free): free space, then "
                           f"{self.where('its previous checkpoint')}") from e

    def where(self, saved: str) -> str:
        """The command that continues this run, and what last.pt holds (`saved`)."""
        if not (self.out / checkpoint.LAST).is_file():
            return "run the same command again (no checkpoint was saved yet)"
        return f"continue with: dali-train --resume {self.out} (last.pt holds {saved})"


def epoch_score(cfg: TrainConfig, record: dict) -> float:
    """What best.pt keeps the best of, higher being better: top-1 for classification, mAP for multilabel, and
    minus the train loss when there is no evaluation (--val-split none)."""
    if cfg.val_split is None:
        return -record["train_loss"]
    return record["map"] if cfg.task == "multilabel" else record["top1"]
