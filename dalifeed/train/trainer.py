"""The reference training loop: dalifeed loader -> DDP model under AMP -> metrics and checkpoints.

Read `fit(run)` first: for each epoch, `train_one_epoch`, `evaluate`, a metrics line and a checkpoint.
`main(cfg)` locks the run folder and builds the `Run` (`build_run`: data, model, optimiser, schedule,
resume) that `fit` uses. Only rank 0 prints and writes. Single process or under torchrun, CPU (gloo) or
GPU (NCCL). SIGINT and SIGTERM finish the current step, save a mid-epoch checkpoint and stop (`Stop`).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from dalifeed.atomic import write_atomic, write_json_atomic
from dalifeed.cliutil import folder_not_created
from dalifeed.format import ManifestError, ShardManifest
from dalifeed.nvml import gpu_stats
from dalifeed.pipelines import make_loader, thread_budget
from dalifeed.train.mixing import BatchMixer, soft_cross_entropy
from dalifeed.runtime import DiskFull, Stopped, folder_lock, free_bytes, is_disk_full, mib
from dalifeed.shardfolder import open_shard_folder

from . import checkpoint, models
from .config import ConfigError, TrainConfig
from .distributed import Dist, all_reduce_min, all_reduce_sum, gather_objects, setup, teardown
from .synthetic import SyntheticLoader


class TrainingDiverged(Exception):
    """The loss stayed non-finite for `max_bad_steps` optimizer steps in a row."""


class TrainingStopped(Stopped):
    """SIGINT or SIGTERM stopped the run cleanly; `detail` says what last.pt holds and how to resume."""

    def __init__(self, signum: int, detail: str):
        super().__init__(signum)
        self.detail = detail


# ----------------------------------------------------------------------------------------------------
# set-up pieces


def build_model(cfg: TrainConfig, num_classes: int) -> tuple[torch.nn.Module, list[str]]:
    try:
        model = models.build_model(cfg.model, num_classes, cfg.width, cfg.image_size)
    except models.ModelError as e:
        raise ConfigError(str(e)) from None
    replaced = checkpoint.load_pretrained(model, cfg.pretrained) if cfg.pretrained else []
    return model, replaced


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """None means full precision."""
    if cfg.amp == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[cfg.amp]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and normalisation weights (every parameter with fewer than 2 dims)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """LR multiplier per optimizer step: linear warm-up from ~0, then cosine down to `min_ratio`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# ----------------------------------------------------------------------------------------------------
# one epoch


@dataclass
class EpochStats:
    loss: float = 0.0
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
    best_top1: float = -1.0
    bad_streak: int = 0


class Stop:
    """A stop request from SIGINT or SIGTERM, honoured between optimizer steps: the signal only records itself,
    the ranks agree on it in the all-reduce every step already does (see `optimizer_step`), and the loop
    saves a mid-epoch checkpoint and raises `TrainingStopped`. A second Ctrl-C (SIGINT) stops at once; a
    repeated SIGTERM is the same request, not an order to hurry: under Slurm a rank gets one from Slurm (which
    signals every process of a job step) and one from torchrun (which forwards the one it got)."""

    def __init__(self) -> None:
        self.requested = 0  # signal number seen by this process
        self.agreed = 0  # signal number all ranks agreed on after the last optimizer step

    @contextmanager
    def listening(self):
        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise Stopped(signum)  # Ctrl-C again: no more waiting
            self.requested = self.requested or signum

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def train_one_epoch(model, ema, loader, optimizer, scheduler, scaler, cfg: TrainConfig, dist: Dist,
                    dtype: torch.dtype | None, state: TrainState, profiler=None, stats: EpochStats | None = None,
                    save_midway=None, stop: Stop | None = None, run_log: "RunLog | None" = None) -> EpochStats:
    """One epoch, or the rest of one: resuming mid-epoch, `stats` are those of the part already run and the
    loader yields the rest. `save_midway(stats)` runs every `cfg.checkpoint_every` optimizer steps, and when
    a `stop` is agreed (then the epoch ends early, with `stop.agreed` set). `run_log` takes the per-step
    TensorBoard scalars (`EpochProgress`)."""
    model.train()
    stats = stats or EpochStats()
    steps = len(loader) // cfg.accum_steps
    progress = EpochProgress(cfg, dist, state, steps, stats, run_log)
    loss_sum = torch.zeros(2, device=dist.device)  # (sum of losses, count) for this step, kept on device
    finite = torch.ones(1, device=dist.device)
    seconds_before = stats.seconds
    mixer = BatchMixer(cfg.mixup_alpha, cfg.cutmix_alpha, seed=cfg.seed, rank=dist.rank)
    start = wait_start = time.perf_counter()
    for i, (images, labels) in enumerate(loader, start=stats.steps * cfg.accum_steps):
        if i >= steps * cfg.accum_steps:
            break  # an incomplete accumulation window at the end of the epoch is dropped
        stats.data_wait += time.perf_counter() - wait_start
        if cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        last_micro = (i + 1) % cfg.accum_steps == 0
        # DDP all-reduces gradients on every backward unless told not to: only the last micro-step syncs
        sync = nullcontext() if last_micro or not dist.enabled else model.no_sync()
        with sync:
            # mixup/cutmix: drawn from (seed, rank, epoch, batch) alone, so a resumed batch mixes as before
            mixed = mixer.mix_images(images, state.epoch, i) if mixer.enabled else None
            with torch.autocast(dist.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                if mixed is None:
                    loss = task_loss(cfg, model(images), labels)
                else:
                    logits = model(mixed[0])
                    targets = mixer.mix_targets(labels, mixed[1], logits.shape[1])
                    loss = soft_cross_entropy(logits, targets, cfg.label_smoothing)
            scaler.scale(loss / cfg.accum_steps).backward()
        finite *= torch.isfinite(loss.detach()).float()
        loss_sum += torch.stack([loss.detach().float().nan_to_num(0.0), torch.ones((), device=dist.device)])
        stats.images += labels.shape[0]
        if last_micro:
            taken = optimizer_step(model, ema, optimizer, scheduler, scaler, cfg, finite, state, stats, dist.is_main,
                                   stop)
            stats.steps += 1
            progress.step_done(stats, loss_sum, taken, optimizer.param_groups[0]["lr"])
            loss_sum.zero_()
            finite.fill_(1.0)
            if profiler is not None:
                profiler.step()
            stopping = stop is not None and stop.agreed
            periodic = cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0
            if save_midway and (stopping or periodic) and stats.steps < steps:
                progress.settle(stats)
                save_midway(replace(stats, seconds=seconds_before + time.perf_counter() - start))
            if stopping:
                break
        wait_start = time.perf_counter()
    progress.close(stats)
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
    stats.seconds = seconds_before + time.perf_counter() - start
    stats.loss /= max(1, stats.steps - stats.bad_steps)  # mean over the steps that were taken
    return stats


class EpochProgress:
    """What rank 0 shows while an epoch runs, between the lines `finish_epoch` prints: a tqdm bar where a
    person watches (stderr is a terminal); where stdout is not a terminal (Slurm, nohup, `> log`) a line every
    `cfg.progress_every` seconds; and every `cfg.tensorboard_every` optimizer steps, per-step TensorBoard
    scalars. The loss is summed on the device and read only when one of these shows it, so they add no host
    sync to a step. That sum, in float64 and in step order, is also the epoch's `stats.loss` (written back by
    `settle`): a run resumed mid-epoch goes on from the checkpoint's sum and adds exactly what an
    uninterrupted run adds, however often its sum was read."""

    def __init__(self, cfg: TrainConfig, dist: Dist, state: TrainState, steps: int, stats: EpochStats,
                 run_log: "RunLog | None" = None):
        self.cfg, self.dist, self.state, self.steps = cfg, dist, state, steps
        self.loss_total = torch.tensor(stats.loss, dtype=torch.float64, device=dist.device)  # of steps taken
        self.start, self.seconds_before, self.steps_before = time.perf_counter(), stats.seconds, stats.steps
        self.bar = tqdm(total=steps, initial=stats.steps, desc=f"epoch {state.epoch}", unit="step",
                        dynamic_ncols=True, leave=False, disable=not (dist.is_main and sys.stderr.isatty()))
        self.lines = dist.is_main and cfg.progress_every > 0 and not sys.stdout.isatty()
        self.next_line = self.start + cfg.progress_every
        self.run_log = run_log if dist.is_main and cfg.tensorboard_every and run_log and run_log.tb else None
        # where the last TensorBoard point was: time, images, data wait, loss sum, steps taken
        self.mark = (self.start, stats.images, stats.data_wait, stats.loss, stats.steps - stats.bad_steps)

    def step_done(self, stats: EpochStats, loss_sum: torch.Tensor, taken: bool, lr: float) -> None:
        """After each optimizer step (`taken`: applied; `loss_sum`: its micro-steps' (loss sum, count))."""
        if taken:
            self.loss_total += (loss_sum[0] / loss_sum[1]).double()
        self.bar.update(1)
        now = time.perf_counter()
        if not self.bar.disable and stats.steps % 10 == 0:
            self.bar.set_postfix(loss=f"{self.mean_loss(stats):.3f}", lr=f"{lr:.3g}",
                                 img_s=f"{self.images_per_s(stats, now):.0f}")
        if self.lines and now >= self.next_line:
            self.next_line = now + self.cfg.progress_every
            print(self.line(stats, now), flush=True)
        if self.run_log is not None and self.state.step % self.cfg.tensorboard_every == 0:
            self.write_scalars(stats, now, lr)

    def mean_loss(self, stats: EpochStats) -> float:
        return float(self.loss_total) / max(1, stats.steps - stats.bad_steps)  # the one device read

    def images_per_s(self, stats: EpochStats, now: float) -> float:
        return stats.images * self.dist.world_size / max(1e-9, self.seconds_before + now - self.start)

    def line(self, stats: EpochStats, now: float) -> str:
        """`epoch 3 step 412/1251: 2519 images/s, loss 2.871, data wait 4%, left: epoch 05:31, run 7:42:10`;
        the rates over the epoch so far, the time left at this process's pace of steps (not counting
        evaluation)."""
        elapsed = self.seconds_before + now - self.start
        seconds_per_step = (now - self.start) / max(1, stats.steps - self.steps_before)
        epoch_left = (self.steps - stats.steps) * seconds_per_step
        run_left = epoch_left + (self.cfg.epochs - self.state.epoch - 1) * self.steps * seconds_per_step
        return (f"epoch {self.state.epoch} step {stats.steps}/{self.steps}: {self.images_per_s(stats, now):.0f} "
                f"images/s, loss {self.mean_loss(stats):.4g}, data wait {stats.data_wait / max(1e-9, elapsed):.0%}, "
                f"left: epoch {tqdm.format_interval(epoch_left)}, run {tqdm.format_interval(run_left)}")

    def write_scalars(self, stats: EpochStats, now: float, lr: float) -> None:
        """TensorBoard's step/ scalars, as means over the steps since the previous point."""
        start, images, data_wait, loss, taken = self.mark
        loss_now, taken_now = float(self.loss_total), stats.steps - stats.bad_steps
        seconds = max(1e-9, now - start)
        scalars = {"step/lr": lr, "step/images_per_s": (stats.images - images) * self.dist.world_size / seconds,
                   "step/data_wait_share": (stats.data_wait - data_wait) / seconds}
        if taken_now > taken:
            scalars["step/train_loss"] = (loss_now - loss) / (taken_now - taken)
        self.run_log.write_step(self.state.step, scalars)
        self.mark = (now, stats.images, stats.data_wait, loss_now, taken_now)

    def settle(self, stats: EpochStats) -> None:
        """Write the device's loss sum into `stats.loss` (before a checkpoint takes the stats, and at the end)."""
        stats.loss = float(self.loss_total)

    def close(self, stats: EpochStats) -> None:
        self.bar.close()
        self.settle(stats)


def optimizer_step(model, ema, optimizer, scheduler, scaler, cfg: TrainConfig, finite: torch.Tensor,
                   state: TrainState, stats: EpochStats, verbose: bool, stop: Stop | None = None) -> bool:
    """Step unless some rank saw a non-finite loss or gradient in this window (all ranks agree, so weights stay
    equal); count skipped steps and abort after `max_bad_steps` in a row. Returns whether it stepped.
    The check costs one host sync per optimizer step, the price of never applying a NaN update; the same
    all-reduce carries any rank's stop request into `stop.agreed`."""
    ok = finite.clone()
    if not scaler.is_enabled():  # fp16's GradScaler skips non-finite gradients itself and lowers its scale
        # a finite loss can still back-propagate inf/NaN gradients, and one such update poisons the weights
        ok *= torch.isfinite(grad_norm(model)).float().to(ok.device)
    requested = float(stop.requested) if stop is not None else 0.0
    agreed = all_reduce_min(torch.cat([ok, torch.tensor([-requested], device=ok.device)]))  # min of -signum: max
    if stop is not None:
        stop.agreed = int(-agreed[1].item())
    if not bool(agreed[0].item()):
        optimizer.zero_grad(set_to_none=True)
        stats.bad_steps += 1
        state.bad_streak += 1
        if verbose:
            print(f"warning: non-finite loss or gradient at epoch {state.epoch} step {state.step}: step skipped "
                  f"({state.bad_streak} in a row)", flush=True)
        if state.bad_streak >= cfg.max_bad_steps:
            raise TrainingDiverged(
                f"training diverged: loss or gradients were not finite for {state.bad_streak} steps in a row (epoch {state.epoch}, step {state.step}); "
                f"lower --lr, add --clip-grad, or use --amp bf16/off")
        state.step += 1
        scheduler.step()  # the schedule follows steps taken or not, so a resumed run lines up
        return False
    state.bad_streak = 0
    if cfg.clip_grad:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    state.step += 1
    if ema is not None:
        ema.update_parameters(unwrap(model))
    return True


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


def task_loss(cfg: TrainConfig, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """classify: cross-entropy against class indices; multilabel: binary cross-entropy per class against
    multi-hot targets (each class present or not, independently)."""
    if cfg.task == "multilabel":
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float())
    return F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing)


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per class (columns), the mean of the precisions at the rank of each positive when samples are sorted by
    score (sklearn's average_precision_score, no interpolation); NaN for a class with no positive."""
    order = scores.argsort(dim=0, descending=True, stable=True)
    hits = targets.gather(0, order).double()
    precision = hits.cumsum(0) / torch.arange(1, len(scores) + 1, dtype=torch.float64, device=scores.device)[:, None]
    positives = hits.sum(0)
    return torch.where(positives > 0, (precision * hits).sum(0) / positives.clamp(min=1), torch.nan)


@torch.no_grad()
def evaluate_multilabel(model, loader, dist: Dist, dtype: torch.dtype | None) -> dict:
    """BCE loss and mean average precision over the classes present in the split (`map`), over exactly the
    whole split: AP needs every score at once, so each rank's scores are gathered (small: N x classes)."""
    model.eval()
    scores, targets = [], []
    for images, labels in loader:
        with torch.autocast(dist.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(images)
        scores.append(logits.float().cpu())
        targets.append(labels.float().cpu())
    parts = gather_objects((torch.cat(scores), torch.cat(targets)))
    scores, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    loss = F.binary_cross_entropy_with_logits(scores, targets).item()
    ap = average_precision(scores, targets)
    present = ~ap.isnan()
    return {"val_loss": loss, "map": float(ap[present].mean()) if present.any() else float("nan"),
            "map_classes": int(present.sum()), "val_samples": len(scores)}


@torch.no_grad()
def evaluate(model, loader, dist: Dist, dtype: torch.dtype | None, num_classes: int) -> dict:
    """Loss, top-1 and top-5 over exactly the whole split: every rank counts its own samples, the sums are
    all-reduced, and the loader never yields padding."""
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, device=dist.device, dtype=torch.float64)  # loss sum, top1, topk, count
    for images, labels in loader:
        with torch.autocast(dist.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        topk = logits.topk(k, dim=1).indices
        totals[1] += (topk[:, 0] == labels).sum()
        totals[2] += (topk == labels[:, None]).any(dim=1).sum()
        totals[3] += labels.shape[0]
    loss, top1, top5, count = all_reduce_sum(totals).tolist()
    return {"val_loss": loss / count, "top1": top1 / count, "top5": top5 / count, "val_samples": int(count)}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = model.module if isinstance(model, DDP) else model
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper


# ----------------------------------------------------------------------------------------------------
# the run: the loop first, then how it is built


@dataclass
class TrainResult:
    metrics: dict  # the last epoch's record, as in metrics.jsonl
    model: torch.nn.Module  # this rank's trained model, unwrapped from DDP/compile


def main(cfg: TrainConfig, resume: dict | None = None) -> TrainResult:
    """Train `cfg`; `resume` is a loaded checkpoint to continue from. Rank 0 holds RUN's lock throughout."""
    cfg.validate()
    dist = setup(cfg.device)
    try:
        if dist.is_main:
            make_run_folder(cfg.out)
        with folder_lock(cfg.out, "dali-train") if dist.is_main else nullcontext():
            return fit(build_run(cfg, dist, resume))
    finally:
        teardown()


def make_run_folder(out: str) -> None:
    """--out, made before its lock is taken: a folder that cannot be made is a usage error naming it."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if is_disk_full(e):
            raise DiskFull(f"--out {out}: {e.strerror}") from e
        raise ConfigError(folder_not_created("--out", out, e)) from None


def fit(run: "Run") -> TrainResult:
    """The epochs: train, evaluate, record, checkpoint; stop cleanly when a signal asks."""
    cfg, dist, state = run.cfg, run.dist, run.state
    record: dict = {}
    if state.epoch >= cfg.epochs and dist.is_main:
        print(f"{run.out}: this run has finished all {cfg.epochs} epochs; nothing to do (raise --epochs to go on)")
    with run.profiler or nullcontext(), run.stop.listening():
        for epoch in range(state.epoch, cfg.epochs):
            state.epoch = epoch
            partial = run.start_epoch(epoch)
            stats = train_one_epoch(run.train_model, run.ema, run.train_loader, run.optimizer, run.scheduler,
                                    run.scaler, cfg, dist, run.dtype, state, run.profiler, partial, run.save_midway,
                                    run.stop, run.log)
            if run.stop.agreed and stats.steps < len(run.train_loader) // cfg.accum_steps:
                raise TrainingStopped(run.stop.agreed, run.where(f"epoch {epoch}, step {stats.steps} of "
                                                                 f"{len(run.train_loader) // cfg.accum_steps}"))
            record = {"epoch": epoch, "lr": run.optimizer.param_groups[0]["lr"], "train_loss": stats.loss,
                      "images_per_s": stats.images * dist.world_size / stats.seconds, "epoch_seconds": stats.seconds,
                      "data_wait_share": stats.data_wait / stats.seconds, "bad_steps": stats.bad_steps}
            record.update(run.evaluate())
            record.update(gpu_stats(dist.device))
            state.epoch = epoch + 1
            run.finish_epoch(record)
            if run.stop.agreed or run.stop.requested and not dist.enabled:
                raise TrainingStopped(run.stop.agreed or run.stop.requested, run.where(f"the end of epoch {epoch}"))
    run.log.close()
    return TrainResult(record, unwrap(run.model))


@dataclass
class Run:
    """Everything a run holds once built; `fit` drives it. Rank 0 writes, every rank trains."""

    cfg: TrainConfig
    dist: Dist
    manifest: ShardManifest
    model: torch.nn.Module  # unwrapped: what checkpoints hold
    train_model: torch.nn.Module  # what trains: DDP and/or torch.compile around `model`
    ema: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    dtype: torch.dtype | None
    train_loader: object
    val_loader: object | None
    state: TrainState
    log: "RunLog"
    profiler: object | None
    midway: dict | None  # the mid-epoch checkpoint this run resumes inside, until its epoch starts
    stop: Stop = field(default_factory=Stop)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def start_epoch(self, epoch: int) -> EpochStats | None:
        """Point the loader at `epoch`, or at the rest of it when resuming mid-epoch (then returns the
        statistics of the part already run)."""
        if self.midway is None:
            self.train_loader.set_epoch(epoch)
            return None
        self.train_loader.load_state_dict(self.midway["loaders"][self.dist.rank])
        partial, self.midway = EpochStats(**self.midway["stats"]), None
        return partial

    def evaluate(self) -> dict:
        if self.val_loader is None:
            return {}
        k = self.manifest.num_classes
        if self.cfg.task == "multilabel":
            def score(model):
                return evaluate_multilabel(model, self.val_loader, self.dist, self.dtype)
        else:
            def score(model):
                return evaluate(model, self.val_loader, self.dist, self.dtype, k)
        record = score(self.train_model)
        if self.ema is not None:
            ema = score(self.ema.module)
            record.update({f"ema_{name}": v for name, v in ema.items() if name != "val_samples"})
        return record

    def payload(self, metrics: dict | None) -> dict:
        """Everything a resume needs: weights, optimiser, schedule, scaler, EMA, counters, RNG states, config,
        and the number of processes that trained (a resume on another number keeps the global batch)."""
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None, "state": vars(self.state).copy(),
            "rng": checkpoint.rng_state(), "config": self.cfg.to_json(), "classes": self.manifest.classes,
            "metrics": metrics, "world_size": self.dist.world_size,
        }

    def save(self, path: Path, payload: dict) -> None:
        try:
            checkpoint.save(path, payload)
        except DiskFull as e:
            raise DiskFull(f"{e} (a checkpoint of this run takes about {mib(checkpoint.size_of(payload))}, "
                           f"{mib(free_bytes(path.parent))} free): free space, then "
                           f"{self.where('its previous checkpoint')}") from e

    def save_midway(self, stats: EpochStats) -> None:
        loaders = gather_objects(self.train_loader.state_dict())  # every rank's reader position
        if self.dist.is_main:
            payload = self.payload(metrics=None)
            payload["midway"] = {"stats": asdict(stats), "loaders": loaders}
            self.save(self.out / checkpoint.LAST, payload)

    def finish_epoch(self, record: dict) -> None:
        """Rank 0: metrics line first, then last.pt (and best.pt); a crash between them only replays the epoch."""
        if not self.dist.is_main:
            return
        top1 = record.get("top1", record.get("map", -record["train_loss"]))  # the score best.pt keeps
        is_best = top1 > self.state.best_top1
        self.state.best_top1 = max(self.state.best_top1, top1)
        self.log.write(record)
        print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()), flush=True)
        payload = self.payload(metrics=record)
        self.save(self.out / checkpoint.LAST, payload)
        if is_best:
            self.save(self.out / checkpoint.BEST, payload)

    def where(self, saved: str) -> str:
        """The command that continues this run, and what last.pt holds (`saved`)."""
        if not (self.out / checkpoint.LAST).is_file():
            return "run the same command again (no checkpoint was saved yet)"
        return f"continue with: dali-train --resume {self.out} (last.pt holds {saved})"


def build_run(cfg: TrainConfig, dist: Dist, resume: dict | None) -> Run:
    """Data, model, optimiser, schedule and precision for `cfg` on this process; restored from `resume`."""
    out = Path(cfg.out)
    manifest = load_manifest(cfg)
    midway = resume.get("midway") if resume is not None else None
    if resume is not None:
        check_resumable(cfg, dist, resume, manifest)
    dtype = amp_dtype(cfg, dist.device)
    budget = thread_budget(loader_device(cfg, dist))
    if dist.device.type == "cuda":
        # every batch has the same shape (--image-size): cuDNN times its algorithms once per layer shape in
        # the first steps and keeps the fastest (gpu-check leaves the first epoch out for it)
        torch.backends.cudnn.benchmark = True
    if dist.is_main:
        print(f"dali-train config: {json.dumps(cfg.to_json())}")
        print(f"world size {dist.world_size}, device {dist.device}, {manifest.num_classes} classes, "
              f"{manifest.num_samples(cfg.train_split)} train samples")
        print(f"--dali-threads {cfg.workers}: DALI threads per pipeline" if cfg.workers else budget.describe())
        write_json_atomic(out / "config.json", cfg.to_json())
        if cfg.val_split is None:
            print("--val-split none: no evaluation; best.pt keeps the epoch of lowest train loss", flush=True)
        if dtype == torch.float16 and dist.device.type == "cpu":
            print("warning: --amp fp16 on the CPU runs about 10x slower than fp32 (PyTorch has few fp16 CPU "
                  "kernels); use --amp off, or bf16 on a CPU with AVX-512 BF16 or AMX", flush=True)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, replaced = build_model(cfg, manifest.num_classes)
    if replaced and dist.is_main:
        print(f"--pretrained: re-initialised {', '.join(replaced)} (class count differs)")
    model = model.to(dist.device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema), use_buffers=True) if cfg.ema else None

    check_batch_fits(cfg, dist, manifest)
    loader_args = dict(rank=dist.rank, world_size=dist.world_size, device=loader_device(cfg, dist),
                       image_size=cfg.image_size, channels_last=cfg.channels_last,
                       num_threads=cfg.workers or budget.threads,
                       device_id=dist.local_rank if dist.device.type == "cuda" else None, check=cfg.check_shards,
                       hw_decoder_load=cfg.hw_decoder_load)
    # DALI's checkpointing costs nothing measurable (docs; 575-625 images/s either way here) and lets any
    # step become a mid-epoch checkpoint: when --checkpoint-every says, and when a signal stops the run
    loader_args["multilabel"] = cfg.task == "multilabel"
    train_loader = make_loader(cfg.data, cfg.train_split, cfg.batch_size, seed=cfg.seed, augment=cfg.train_augment(),
                               checkpointing=True, train=True, **loader_args)
    val_loader = make_loader(cfg.data, cfg.val_split, cfg.batch_size, seed=cfg.seed, train=False, **loader_args) \
        if cfg.val_split is not None else None
    if cfg.synthetic:
        train_loader = SyntheticLoader(train_loader)

    global_batch = cfg.batch_size * dist.world_size * cfg.accum_steps
    lr = cfg.lr * global_batch / 256
    optimizer = build_optimizer(cfg, model, lr)
    steps_per_epoch = len(train_loader) // cfg.accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_loader)} batches per epoch is fewer than --accum-steps {cfg.accum_steps}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(
        cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch), cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler(dist.device.type, enabled=dtype == torch.float16)

    state = TrainState()
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        scaler.load_state_dict(resume["scaler"])
        if ema is not None:
            ema.load_state_dict(resume["ema"])
        state = TrainState(**resume["state"])
        checkpoint.restore_rng(resume["rng"])
    train_model = DDP(model, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None) \
        if dist.enabled else model
    if cfg.compile:
        train_model = torch.compile(train_model)

    log = RunLog(out, dist.is_main, state.epoch if resume is not None else None,
                 state.step if resume is not None else None)
    if dist.is_main:
        where = f", batch {midway['loaders'][0]['batches_done']} of {len(train_loader)}" if midway else ""
        print(f"global batch {global_batch} (lr {lr:.4g}), {steps_per_epoch} steps/epoch, "
              f"amp {dtype or 'off'}, starting at epoch {state.epoch}{where}"
              + (", synthetic data (one batch, repeated)" if cfg.synthetic else ""))
    return Run(cfg, dist, manifest, model, train_model, ema, optimizer, scheduler, scaler, dtype, train_loader,
               val_loader, state, log, make_profiler(cfg, out, dist), midway)


def loader_device(cfg: TrainConfig, dist: Dist) -> str:
    """Where the pipeline decodes: on the training device, except that --device hybrid decodes on the CPU."""
    if dist.device.type != "cuda":
        return "cpu"
    return "hybrid" if cfg.device == "hybrid" else "gpu"


def check_resumable(cfg: TrainConfig, dist: Dist, resume: dict, manifest: ShardManifest) -> None:
    """Refuse a checkpoint of other classes, or saved mid-epoch by another number of processes; on another
    number of processes after an epoch's end, keep the run's global batch (and so its learning rate and
    schedule) by changing the per-process batch, or refuse when it does not divide."""
    if resume["classes"] != manifest.classes:
        raise ConfigError(f"{cfg.out}: checkpoint was trained on other classes than {cfg.data} holds")
    saved_world = resume.get("world_size", dist.world_size)
    midway = resume.get("midway")
    if midway is not None and len(midway["loaders"]) != dist.world_size:
        raise ConfigError(f"{cfg.out}: last.pt was saved mid-epoch by {len(midway['loaders'])} processes; "
                          f"resume it with as many (not {dist.world_size})")
    if saved_world == dist.world_size:
        return
    global_batch = cfg.batch_size * saved_world
    if global_batch % dist.world_size:
        raise ConfigError(f"{cfg.out}: trained on {saved_world} processes with global batch {global_batch} "
                          f"({cfg.batch_size} each x {cfg.accum_steps} steps); {dist.world_size} processes cannot "
                          f"share it evenly: resume on a number of processes that divides {global_batch}")
    old = cfg.batch_size
    cfg.batch_size = global_batch // dist.world_size
    if dist.is_main:
        print(f"resuming on {dist.world_size} processes (trained on {saved_world}): --batch-size {old} -> "
              f"{cfg.batch_size} per process keeps the global batch {global_batch * cfg.accum_steps}, the "
              f"learning rate and the schedule; the order of samples differs from an uninterrupted run", flush=True)


def check_batch_fits(cfg: TrainConfig, dist: Dist, manifest: ShardManifest) -> None:
    per_rank = manifest.num_samples(cfg.train_split) // dist.world_size
    if per_rank < cfg.batch_size * cfg.accum_steps:
        raise ConfigError(f"--batch-size {cfg.batch_size} (x --accum-steps {cfg.accum_steps}) is more than the "
                          f"{per_rank} training samples each of {dist.world_size} process(es) gets "
                          f"({manifest.num_samples(cfg.train_split)} in {cfg.data}); lower it")


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
                raise DiskFull(f"{self.metrics}: {e.strerror}; free space, then dali-train --resume {self.out}") from e
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


def make_profiler(cfg: TrainConfig, out: Path, dist: Dist):
    if not cfg.profile or not dist.is_main:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dist.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=1, warmup=1, active=cfg.profile, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(out / "profile_trace.json")),
    )


def check_splits(cfg: TrainConfig, manifest: ShardManifest) -> None:
    """Both splits exist and hold samples: a typo in a split name (--val-split validation) is refused before
    training, not trained through without evaluation. No evaluation is asked for with --val-split none."""
    for option, split in (("--train-split", cfg.train_split), ("--val-split", cfg.val_split)):
        if split is None:
            continue
        hint = "; --val-split none trains without evaluation" if option == "--val-split" else ""
        if split not in manifest.splits:
            raise ConfigError(f"{option} {split}: --data {cfg.data} has no such split (has: "
                              f"{', '.join(manifest.splits)}){hint}")
        if not manifest.num_samples(split):
            raise ConfigError(f"{option} {split}: that split of --data {cfg.data} holds no samples{hint}")


def load_manifest(cfg: TrainConfig) -> ShardManifest:
    try:
        manifest = open_shard_folder(cfg.data)  # a folder, or s3://bucket/prefix
    except ManifestError as e:
        raise ConfigError(str(e)) from None
    if cfg.task == "multilabel" and manifest.kind != "coco":
        raise ConfigError(f"--task multilabel needs COCO shards (shard-convert coco); {cfg.data} holds {manifest.kind}")
    if cfg.task == "classify" and manifest.kind == "coco":  # their samples hold label lists, not one class
        raise ConfigError(f"--data {cfg.data} holds COCO shards: use --task multilabel (--task classify needs "
                          f"ImageFolder shards)")
    check_splits(cfg, manifest)
    return manifest
