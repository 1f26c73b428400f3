"""`Run`: everything a run holds once built (`trainer.build_run`), what `trainer.fit` drives and
`trainer.train_one_epoch` trains with; at each epoch's end its metrics line and checkpoints (`finish_epoch`),
in the middle of one a mid-epoch checkpoint (`save_midway`), and what best.pt keeps the best of
(`epoch_score`). Beside it, what a run counts (`EpochStats`, `TrainState`: plain records) and what rank 0
writes for every epoch (`RunLog`: metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dalifeed.atomic import write_atomic
from dalifeed.pipelines.elastic import merge_rank_states
from dalifeed.runtime import DiskFull, free_bytes, is_disk_full, mib, write_remedy

from . import checkpoint
from .config import TrainConfig
from .distributed import Dist, gather_objects, log
from .stop import StepChecks, Stop


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
    best_score: float = float("-inf")  # the best `epoch_score` so far (minus a train loss may be below -1)
    bad_streak: int = 0

    @classmethod
    def from_checkpoint(cls, saved: dict) -> TrainState:
        """A checkpoint's "state"; checkpoints written before the score had its name called it best_top1."""
        saved = dict(saved)
        if "best_top1" in saved:
            saved["best_score"] = saved.pop("best_top1")
        return cls(**saved)


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
    swa: torch.nn.Module | None = None  # --swa-start's average (swa.py)
    classes: list[str] = field(default_factory=list)
    train_model: torch.nn.Module | None = None  # what trains: DDP and/or torch.compile around `model` (None: it)
    state: TrainState = field(default_factory=TrainState)
    run_log: RunLog | None = None
    profiler: object | None = None
    midway: dict | None = None  # the mid-epoch checkpoint this run resumes inside, until its epoch starts
    sample_log: SampleLog | None = None  # --log-samples
    stop: Stop = field(default_factory=Stop)
    checks: StepChecks | None = None  # skipped steps tallied on the device, and when the host reads them
    data: list | None = None  # the shards it trains on (`ShardData.contents`): what checkpoints record
    data_changed: str | None = None  # how they differ from the resumed checkpoint's (--allow-data-change)

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
        states = self.midway["loaders"]
        if len(states) == self.dist.world_size:  # each rank its own reader state: exactly the rest of the epoch
            self.train_loader.load_state_dict(states[self.dist.rank])
        else:  # saved by another number of ranks: the samples none of them consumed, shared by these
            merged = merge_rank_states(states)
            self.train_loader.load_state_dict(merged)
            log(f"the rest of epoch {epoch}: its samples not trained by the {len(states)} processes that saved it "
                f"({merged['samples_done']} were), shared by {self.dist.world_size}")
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
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "swa": self.swa.state_dict() if self.swa is not None else None, "state": asdict(self.state),
            "rng": checkpoint.rng_state(), "config": self.cfg.to_json(), "classes": self.classes,
            "metrics": checkpoint.untimed(metrics), "world_size": self.dist.world_size, "data": self.data,
            "data_changed": self.data_changed,
        }

    def save(self, path: Path, payload: dict) -> None:
        try:
            checkpoint.save(path, payload)
        except DiskFull as e:
            raise DiskFull(f"{e} (a checkpoint of this run takes about {mib(checkpoint.size_of(payload))}, "
                           f"{mib(free_bytes(path.parent))} free): {write_remedy(e)}, then "
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


class SampleLog:
    """--log-samples: RUN/samples/rank<R>-of-<W>.jsonl, a line per batch this rank trained on: the epoch, the
    batch's index in the epoch and its samples as the loader names them (`last_samples`: `SHARD:POSITION`,
    mixed `DATASET/SHARD:POSITION`). Appended, line by line, so that a run stopped by a signal has logged
    every batch its checkpoint holds; a batch run again after a crash (SIGKILL) is logged again."""

    def __init__(self, out: Path, dist: Dist):
        folder = out / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / f"rank{dist.rank}-of-{dist.world_size}.jsonl", "a", buffering=1)

    def write(self, epoch: int, batch: int, samples: list[str]) -> None:
        self.file.write(json.dumps({"epoch": epoch, "batch": batch, "samples": samples}) + "\n")

    def close(self) -> None:
        self.file.close()


class RunLog:
    """Rank 0's outputs: config.json, metrics.jsonl, TensorBoard events when tensorboard is installed: per
    epoch in RUN/tensorboard, per optimizer step (`write_step`) in RUN/tensorboard/steps. A writer each,
    because TensorBoard hides a resumed run's replayed events by step number, which counts epochs in one and
    optimizer steps in the other."""

    def __init__(self, out: Path, enabled: bool, resume_epoch: int | None, resume_step: int | None = None):
        self.out, self.enabled, self.tb, self.steps_tb = out, enabled, None, None
        self.resume_step = resume_step
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.metrics = out / "metrics.jsonl"
        if resume_epoch is not None and self.metrics.exists():
            # epochs after the checkpoint are replayed: drop their lines so none is written twice
            kept = [line for line in self.metrics.read_text().splitlines()
                    if line.strip() and json.loads(line)["epoch"] < resume_epoch]
            write_atomic(self.metrics, "".join(line + "\n" for line in kept).encode())
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the replayed epochs' events, as the metrics lines above are dropped
            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=resume_epoch)
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            if is_disk_full(e):
                raise DiskFull(f"{self.metrics}: {e.strerror}; {write_remedy(e)}, then dali-train --resume "
                               f"{self.out}") from e
            raise
        if self.tb:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self.tb.add_scalar(key, value, record["epoch"])
            self.tb.flush()

    def write_step(self, step: int, scalars: dict) -> None:
        """Per-step scalars at optimizer step `step` (the writer is made on first use)."""
        if not self.tb:
            return
        if self.steps_tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # the steps after the checkpoint a resumed run started from are replayed: hide their old events
            purge = None if self.resume_step is None else self.resume_step + 1
            self.steps_tb = SummaryWriter(str(self.out / "tensorboard" / "steps"), purge_step=purge)
        for key, value in scalars.items():
            self.steps_tb.add_scalar(key, value, step)
        self.steps_tb.flush()

    def close(self) -> None:
        for writer in (self.tb, self.steps_tb):
            if writer:
                writer.close()
