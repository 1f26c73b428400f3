"""The training loop, in the order it runs: `train_one_epoch(run, stats)` -> `optimizer_step` for each
accumulation window and a `check` now and then, then `evaluate` on the validation split. `trainer.fit` calls
both once an epoch; `Run` (run.py) holds what they use.

A step never waits for the device: whether it is applied is decided on the device (`optimizer_step`), the loss
is summed there, and the host reads what happened at a check (stop.py) or when progress is shown (progress.py).
The counting test: tests/test_train_sync.py."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import nullcontext
from itertools import chain

import torch
import torch.nn.functional as F

from .config import TrainConfig
from .distributed import Dist, all_reduce_sum, gather_objects, log
from .mixdata import evaluate_each
from .mixup import BatchMixer, soft_cross_entropy
from .progress import EpochProgress
from .run import Run
from .state import EpochStats
from .stop import agree_to_skip


class TrainingDiverged(Exception):
    """The loss stayed non-finite for `max_bad_steps` optimizer steps in a row."""


def train_one_epoch(run: Run, stats: EpochStats | None = None) -> EpochStats:
    """One epoch, or the rest of one: resuming mid-epoch, `stats` are those of the part already run and the
    loader yields the rest. A mid-epoch checkpoint (`run.save_midway`) every `cfg.checkpoint_every` optimizer
    steps, and when the ranks agree to stop (then the epoch ends early, `run.stop.agreed` set)."""
    cfg, dist, model = run.cfg, run.dist, run.train_model
    model.train()
    stats = stats or EpochStats()
    steps = run.steps_per_epoch
    progress = EpochProgress(cfg, dist, run.state, run.run_log, steps, stats)
    run.checks.start_epoch(run.state.bad_streak, run.state.step)
    losses = torch.zeros(2, device=dist.device)  # this step's (sum of micro-step losses, count), on the device
    finite = torch.ones((), device=dist.device)  # 0 once a micro-step's loss is not finite
    mixer = BatchMixer(cfg.mixup_alpha, cfg.cutmix_alpha, seed=cfg.seed, rank=dist.rank)
    wait_start = time.perf_counter()
    for i, (images, labels) in enumerate(run.train_loader, start=stats.steps * cfg.accum_steps):
        if i >= steps * cfg.accum_steps:
            break  # an incomplete accumulation window at the end of the epoch is dropped
        stats.data_wait += time.perf_counter() - wait_start
        if cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        last_micro = (i + 1) % cfg.accum_steps == 0
        # DDP all-reduces gradients on every backward unless told not to: only the last micro-step syncs
        with nullcontext() if last_micro or not dist.enabled else model.no_sync():
            # mixup/cutmix: drawn from (seed, rank, epoch, batch) alone, so a resumed batch mixes as before
            images, mixing = mixer.mix_images(images, run.state.epoch, i) if mixer.enabled else (images, None)
            with autocast(dist, run.dtype):
                logits = model(images)
                if mixing is None:
                    loss = task_loss(cfg, logits, labels)
                else:  # soft targets: the two classes in the mixed shares, label smoothing on top
                    loss = soft_cross_entropy(logits, mixer.mix_targets(labels, mixing, logits.shape[1]),
                                              cfg.label_smoothing)
            run.scaler.scale(loss / cfg.accum_steps).backward()
        finite *= torch.isfinite(loss.detach()).float()
        losses += torch.stack([loss.detach().float().nan_to_num(0.0), torch.ones((), device=dist.device)])
        stats.images += labels.shape[0]
        if last_micro:
            skipped = optimizer_step(run, finite)
            run.checks.count(skipped)
            stats.steps += 1
            progress.step_done(stats, losses, skipped, run.optimizer.param_groups[0]["lr"])
            losses.zero_()
            finite.fill_(1.0)
            if run.profiler is not None:
                run.profiler.step()
            periodic = cfg.checkpoint_every and run.state.step % cfg.checkpoint_every == 0
            if periodic or run.checks.due(run.state.step):
                check(run, stats)  # before a checkpoint too: a diverged run stops without saving
            if (run.stop.agreed or periodic) and stats.steps < steps:
                run.save_midway(progress.snapshot(stats))
            if run.stop.agreed:
                break
        wait_start = time.perf_counter()
    check(run, stats)  # the steps since the last check, before the epoch's metrics and checkpoint
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
    progress.close(stats)
    stats.loss /= max(1, stats.steps - stats.bad_steps)  # mean over the steps that were taken
    return stats


def check(run: Run, stats: EpochStats) -> None:
    """The host's look at the steps since the previous check (`StepChecks.read`, the one host sync): skipped
    steps are counted in `stats.bad_steps` and warned about, a stop any rank was asked for is agreed
    (`run.stop.agreed`), and `--max-bad-steps` skipped steps in a row stop the run."""
    state = run.state
    seen = run.checks.read(run.stop, state.step)
    stats.bad_steps += seen.skipped
    state.bad_streak = seen.streak
    if seen.skipped:
        log(f"warning: non-finite loss or gradient in {seen.skipped} of the {seen.steps} optimizer steps up to "
            f"epoch {state.epoch} step {state.step}: skipped ({seen.streak} in a row now)")
    if seen.worst >= run.cfg.max_bad_steps:
        raise TrainingDiverged(f"training diverged: loss or gradients were not finite for {seen.worst} steps in a "
                               f"row by epoch {state.epoch} step {state.step} (--max-bad-steps "
                               f"{run.cfg.max_bad_steps}); lower --lr, add --clip-grad, or use --amp bf16/off")


def autocast(dist: Dist, dtype: torch.dtype | None):
    """Mixed precision in `dtype`; None: full precision."""
    return torch.autocast(dist.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def task_loss(cfg: TrainConfig, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """classify: cross-entropy against class indices; multilabel: binary cross-entropy per class against
    multi-hot targets (each class present or not, independently)."""
    if cfg.task == "multilabel":
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float())
    return F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing)


def optimizer_step(run: Run, finite: torch.Tensor) -> torch.Tensor:
    """Apply the window's gradients, unless some rank saw a non-finite loss or gradient in it: then every rank
    skips (so weights stay equal), on the device. Returns whether it skipped (1.0 or 0.0, on the device, the
    same on every rank), unread: nothing here waits for the device.

    The skip is the fused optimizer's (trainer.build_optimizer): given `found_inf`, its kernel leaves weights and
    state as they were when the flag is set, as GradScaler has it do for fp16 (torch/amp/grad_scaler.py). With
    fp16 the GradScaler decides alone, from the gradients it unscales (a non-finite loss has non-finite
    gradients), and lowers its scale as usual; the loss's flag then counts the step as skipped. The schedule
    steps either way: it follows steps taken or not, so that a resumed run lines up."""
    if not run.scaler.is_enabled():  # fp16's GradScaler checks the gradients itself
        # a finite loss can still back-propagate inf/NaN gradients, and one such update poisons the weights
        finite = finite * torch.isfinite(grad_norm(run.model)).float()
    skipped = agree_to_skip(finite)
    if run.cfg.clip_grad:
        run.scaler.unscale_(run.optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.clip_grad)
    if not run.scaler.is_enabled():
        run.optimizer.found_inf = skipped
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    run.state.step += 1
    if run.ema is not None:
        update_ema(run.ema, run.model, run.cfg.ema, taken=1.0 - skipped)
    return skipped


@torch.no_grad()
def update_ema(ema: torch.optim.swa_utils.AveragedModel, model: torch.nn.Module, decay: float,
               taken: torch.Tensor) -> None:
    """--ema after an optimizer step: the average of the weights (and buffers) moves 1 - decay of the way to
    the model's, takes them on its first update, and stays after a skipped step (`taken` 0.0 on the device).
    The arithmetic of torch's `get_ema_multi_avg_fn`; not `AveragedModel.update_parameters`, which decides its
    first update on the host (`n_averaged == 0`), copies its count to the device every step (each a host sync
    on a GPU) and could skip a step only if the host read whether it was."""
    first = ema.n_averaged == 0  # on the device: trainer.make_model puts the count there
    weight = taken * torch.where(first, 1.0, 1.0 - decay)  # 1: a copy (lerp's exact end), 0: unchanged
    floats, others = defaultdict(lambda: ([], [])), []
    for averaged, current in zip(chain(ema.module.parameters(), ema.module.buffers()),
                                 chain(model.parameters(), model.buffers())):
        if averaged.is_floating_point():
            floats[averaged.dtype][0].append(averaged)
            floats[averaged.dtype][1].append(current.detach())
        else:
            others.append((averaged, current))
    for dtype, (averaged, current) in floats.items():
        torch._foreach_lerp_(averaged, current, weight.to(dtype))
    for averaged, current in others:  # BatchNorm's num_batches_tracked: as get_ema_multi_avg_fn does integers
        moved = torch.where(first, current, averaged * decay + current * (1 - decay))
        averaged.copy_(torch.where(taken > 0, moved, averaged))
    ema.n_averaged += taken.long()


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


# ----------------------------------------------------------------------------------------------------
# after each epoch


def validation_record(run: Run) -> dict:
    """The validation split's metrics for the epoch's metrics line (none with --val-split none): the model's,
    and with --ema the averaged weights' too, prefixed ema_."""
    if run.val_loader is None:
        return {}
    if run.cfg.task == "multilabel":
        def measure(model):
            return evaluate_multilabel(model, run.val_loader, run.dist, run.dtype)
    else:
        def measure(model):
            if hasattr(run.val_loader, "per_dataset"):  # several datasets (--data A --data B): each apart
                return evaluate_each(lambda part: evaluate(model, part, run.dist, run.dtype, len(run.classes)),
                                     run.val_loader)
            return evaluate(model, run.val_loader, run.dist, run.dtype, len(run.classes))
    record = measure(run.train_model)
    if run.ema is not None:
        ema = measure(run.ema.module)
        record.update({f"ema_{name}": v for name, v in ema.items() if name != "val_samples"})
    return record


@torch.no_grad()
def evaluate(model, loader, dist: Dist, dtype: torch.dtype | None, num_classes: int) -> dict:
    """Loss, top-1 and top-5 over exactly the whole split: every rank counts its own samples, the sums are
    all-reduced, and the loader never yields padding."""
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, device=dist.device, dtype=torch.float64)  # loss sum, top1, topk, count
    for images, labels in loader:
        with autocast(dist, dtype):
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        topk = logits.topk(k, dim=1).indices
        totals[1] += (topk[:, 0] == labels).sum()
        totals[2] += (topk == labels[:, None]).any(dim=1).sum()
        totals[3] += labels.shape[0]
    loss, top1, top5, count = all_reduce_sum(totals).tolist()
    return {"val_loss": loss / count, "top1": top1 / count, "top5": top5 / count, "val_samples": int(count)}


@torch.no_grad()
def evaluate_multilabel(model, loader, dist: Dist, dtype: torch.dtype | None) -> dict:
    """BCE loss and mean average precision over the classes present in the split (`map`), over exactly the
    whole split: AP needs every score at once, so each rank's scores are gathered (small: N x classes)."""
    model.eval()
    scores, targets = [], []
    for images, labels in loader:
        with autocast(dist, dtype):
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


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per class (columns), the mean of the precisions at the rank of each positive when samples are sorted by
    score (sklearn's average_precision_score, no interpolation); NaN for a class with no positive."""
    order = scores.argsort(dim=0, descending=True, stable=True)
    hits = targets.gather(0, order).double()
    precision = hits.cumsum(0) / torch.arange(1, len(scores) + 1, dtype=torch.float64, device=scores.device)[:, None]
    positives = hits.sum(0)
    return torch.where(positives > 0, (precision * hits).sum(0) / positives.clamp(min=1), torch.nan)
