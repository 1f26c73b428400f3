"""dali-train's run, top to bottom in the order it happens: `main(cfg)` locks the run folder, builds the run and
fits it. `fit` drives the epochs (train; evaluate, evaluation.py; a metrics line and a checkpoint,
`Run.finish_epoch` in run.py), `train_one_epoch` the steps of one, each a forward pass and loss
(`forward_loss`), backward and `optimizer_step`, with `check`, the host's look every few seconds. Below them,
`build_run` and what it assembles: data, model, optimiser, schedule, precision, restored from a checkpoint
when resuming.

A step never waits for the device: whether it is applied is decided on the device (`optimizer_step`), the loss
is summed there, and the host reads what happened at a check (stop.py) or when progress is shown (progress.py).
The counting test: tests/test_train_sync.py.

Only rank 0 prints and writes. Single process or under torchrun, CPU (gloo) or GPU (NCCL). SIGINT and SIGTERM
stop every rank after the same step (the next check, within about 2 s), with a mid-epoch checkpoint (stop.py).
Whether a command starts a run or continues one is `resume.resolve_run`'s decision, made before `main`."""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dalifeed.atomic import write_json_atomic
from dalifeed.budget import ThreadBudget, thread_budget
from dalifeed.nvml import gpu_stats
from dalifeed.pipelines.dataset import ShardData
from dalifeed.runtime import DiskFull, folder_lock, is_disk_full
from dalifeed.s3 import is_s3_url
from dalifeed.usage import folder_not_created

from . import checkpoint, models
from .config import ConfigError, TrainConfig
from .data import (
    describe_lanes,
    describe_plan,
    loader_device,
    loader_options,
    loader_record,
    make_loaders,
    mix_plan,
    open_data,
)
from .distributed import Dist, launched, log, setup, teardown
from .evaluation import autocast, measurer, validation_record
from .mixup import BatchMixer, soft_cross_entropy
from .progress import EpochProgress
from .resume import check_same_data, resolve_run
from .run import EpochStats, Run, RunLog, SampleLog, TrainState
from .stop import TrainingStopped, agree_to_skip
from .swa import finish_swa, make_swa, swa_path, swa_payload, swa_schedule


class TrainingDiverged(Exception):
    """The loss stayed non-finite for `max_bad_steps` optimizer steps in a row."""


@dataclass
class TrainResult:
    """What `main` returns on each rank once the run has finished.

    Attributes:
        metrics: The last epoch's record, as its line in RUN/metrics.jsonl (epoch, train_loss, top1, top5,
            val_loss, images_per_s, ...).
        model: This rank's trained model, unwrapped from DDP and `torch.compile`.
    """

    metrics: dict
    model: torch.nn.Module


def main(cfg: TrainConfig, resume: str | os.PathLike | dict | None = None) -> TrainResult:
    """Train `cfg` as `dali-train` does: on every process torchrun started (one without it), rank 0 writing
    the run folder `cfg.out` and holding its lock throughout.

    Args:
        cfg: The run's options.
        resume: None starts a new run in `cfg.out` (give a new or empty folder). `"auto"` continues the
            run `cfg.out` holds, from its last.pt, if every option but those a resume may change (epochs,
            workers, profile, compile, checkpoint_every, check_shards, progress_every, tensorboard_every,
            cache_dir, cache_limit, log_samples, allow_data_change) is the same, and starts one when it holds
            none (`dali-train --resume auto`). A run folder continues that run with its saved config, `cfg`'s
            values ignored (`dali-train --resume RUN`). A dict is a checkpoint already loaded (what the
            command line passes). Default None.

    Returns:
        The last epoch's metrics and this rank's trained model.

    Raises:
        ConfigError: An option is out of range, `cfg.out` cannot be used, or the run it holds has other
            options than `cfg` (each named).
        TrainingDiverged: The loss stayed non-finite for `cfg.max_bad_steps` steps in a row.
        ShardDataError: A shard is missing, truncated or unreadable.

    Example:
        ```python
        from dalifeed.train import TrainConfig, main

        result = main(TrainConfig(data="/data/shards", out="runs/r50", epochs=16), resume="auto")
        print(result.metrics["top1"])
        ```
    """
    if isinstance(resume, (str, os.PathLike)):
        run = None if resume == "auto" else Path(resume)
        cfg, resume = resolve_run(cfg, (), run, world_size=launched().world_size)
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


# ----------------------------------------------------------------------------------------------------
# the run: its epochs (`fit`), an epoch's steps (`train_one_epoch`), one step (`forward_loss`, backward,
# `optimizer_step`), and the check the host makes every few seconds (`check`)


def fit(run: Run) -> TrainResult:
    """The epochs: train, evaluate, record, checkpoint; stop cleanly when a signal asks."""
    cfg, state, stop = run.cfg, run.state, run.stop
    record: dict = {}
    if state.epoch >= cfg.epochs:
        log(f"{run.out}: this run has finished all {cfg.epochs} epochs; nothing to do (raise --epochs to go on)")
    with run.profiler or nullcontext(), stop.listening():
        for epoch in range(state.epoch, cfg.epochs):
            state.epoch = epoch
            if run.swa is not None and epoch == cfg.swa_start and run.midway is None:
                log(f"epoch {epoch}: SWA from here on, the weights averaged after every epoch"
                    + (f", lr {cfg.swa_lr:g} per 256 images" if cfg.swa_lr else ""))
            stats = train_one_epoch(run, run.start_epoch(epoch))
            if stop.agreed and stats.steps < run.steps_per_epoch:
                raise TrainingStopped(stop.agreed, run.where(f"epoch {epoch}, step {stats.steps} of "
                                                             f"{run.steps_per_epoch}"))
            record = {"epoch": epoch, "lr": run.optimizer.param_groups[0]["lr"], "train_loss": stats.loss,
                      "images_per_s": stats.images * run.dist.world_size / stats.seconds,
                      "epoch_seconds": stats.seconds, "data_wait_share": stats.data_wait / stats.seconds,
                      "bad_steps": stats.bad_steps}
            averaging = run.swa is not None and epoch >= cfg.swa_start
            if averaging:
                run.swa.update_parameters(run.model)
            record.update(validation_record(run))
            swa_done = averaging and epoch == cfg.epochs - 1
            if swa_done:
                record.update(finish_swa(run, measurer(run)))
            record.update(gpu_stats(run.dist.device))
            if run.data_changed is not None:  # the log says which epoch first trained on other shards
                record["data_changed"], run.data_changed = run.data_changed, None
            state.epoch = epoch + 1
            if swa_done and run.dist.is_main:  # before last.pt: a run that fails in between replays this epoch
                run.save(swa_path(cfg.out), swa_payload(run, record))
            run.finish_epoch(record)
            if stop.agreed or stop.requested and not run.dist.enabled:
                raise TrainingStopped(stop.agreed or stop.requested, run.where(f"the end of epoch {epoch}"))
    run.run_log.close()
    if run.sample_log is not None:
        run.sample_log.close()
    return TrainResult(record, run.model)


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
            loss = forward_loss(run, mixer, images, labels, batch=i)
            run.scaler.scale(loss / cfg.accum_steps).backward()
        finite *= torch.isfinite(loss.detach()).float()
        losses += torch.stack([loss.detach().float().nan_to_num(0.0), torch.ones((), device=dist.device)])
        stats.images += labels.shape[0]
        if run.sample_log is not None:
            run.sample_log.write(run.state.epoch, i, run.train_loader.last_samples)
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


def forward_loss(run: Run, mixer: BatchMixer, images: torch.Tensor, labels: torch.Tensor, batch: int) -> torch.Tensor:
    """The loss of batch `batch` of the epoch, under autocast: mixed first with --mixup-alpha / --cutmix-alpha,
    from (seed, rank, epoch, batch) alone, so that a resumed batch mixes as it did."""
    images, mixing = mixer.mix_images(images, run.state.epoch, batch) if mixer.enabled else (images, None)
    with autocast(run.dist, run.dtype):
        logits = run.train_model(images)
        if mixing is None:
            return task_loss(run.cfg, logits, labels)
        # soft targets: the two classes in the mixed shares, label smoothing on top
        return soft_cross_entropy(logits, mixer.mix_targets(labels, mixing, logits.shape[1]),
                                  run.cfg.label_smoothing)


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

    The skip is the fused optimizer's (build_optimizer, below): given `found_inf`, its kernel leaves weights and
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


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


@torch.no_grad()
def update_ema(ema: torch.optim.swa_utils.AveragedModel, model: torch.nn.Module, decay: float,
               taken: torch.Tensor) -> None:
    """--ema after an optimizer step: the average of the weights (and buffers) moves 1 - decay of the way to
    the model's, takes them on its first update, and stays after a skipped step (`taken` 0.0 on the device).
    The arithmetic of torch's `get_ema_multi_avg_fn`; not `AveragedModel.update_parameters`, which decides its
    first update on the host (`n_averaged == 0`) and could skip a step only if the host read whether it was.

    The weight stays on the device: average x (1 - w) + model x w with `_foreach_mul_.Tensor` and
    `_foreach_add_.List` (their CUDA kernels read a 0-dim tensor on the device: ATen's
    native/cuda/ForeachBinaryOpScalarTensor.cu). `_foreach_lerp_` has no tensor-weight overload in torch 2.14
    (.List, .Scalar, .ScalarList only), so a tensor weight was read with `.item()` in C++: a host sync a step.
    w = 1 gives the model's parameters exactly (x 0 + model), w = 0 the average's (+ model x 0: a skipped step
    leaves the parameters as they were). Buffers are few and move in the forward pass even when the step is
    skipped (BatchNorm's statistics, inf after an fp16 overflow): each keeps the average by a `where`."""
    first = ema.n_averaged == 0  # on the device: trainer.make_model puts the count there
    weight = taken * torch.where(first, 1.0, 1.0 - decay)
    params = defaultdict(lambda: ([], []))
    for averaged, current in zip(ema.module.parameters(), model.parameters()):
        params[averaged.dtype][0].append(averaged)
        params[averaged.dtype][1].append(current.detach())
    for dtype, (averaged, current) in params.items():
        w = weight.to(dtype)
        torch._foreach_mul_(averaged, 1.0 - w)
        torch._foreach_add_(averaged, torch._foreach_mul(current, w))
    for averaged, current in zip(ema.module.buffers(), model.buffers()):
        if averaged.is_floating_point():
            moved = torch.where(first, current, averaged.lerp(current, 1.0 - decay))
        else:  # BatchNorm's num_batches_tracked: as get_ema_multi_avg_fn does integers
            moved = torch.where(first, current, averaged * decay + current * (1 - decay))
        averaged.copy_(torch.where(taken > 0, moved, averaged))
    ema.n_averaged += taken.long()


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


# ----------------------------------------------------------------------------------------------------
# building the run


def build_run(cfg: TrainConfig, dist: Dist, resume: dict | None) -> Run:
    """Data, model, optimiser, schedule and precision for `cfg` on this process; restored from `resume`."""
    data = open_data(cfg, dist)  # --data opened once: kind, splits and batch checked
    contents = data.contents([cfg.train_split] + ([cfg.val_split] if cfg.val_split is not None else []))
    data_changed = None
    if resume is not None:
        if resume["classes"] != data.classes:
            raise ConfigError(f"{cfg.out}: checkpoint was trained on other classes than {cfg.data} holds")
        # a mid-epoch checkpoint of the epoch that began on changed shards carries the change to its metrics line
        data_changed = check_same_data(cfg, resume, contents) or resume.get("data_changed")
    dtype = amp_dtype(cfg, dist.device)
    budget = thread_budget(loader_device(cfg, dist))
    options = loader_options(cfg, dist, threads=cfg.workers or budget.threads)
    log_start(cfg, dist, data, dtype, budget, options)
    if dist.device.type == "cuda":
        # every batch has the same shape (--image-size): cuDNN times its algorithms once per layer shape in
        # the first steps and keeps the fastest (gpu-check leaves the first epoch out for it)
        torch.backends.cudnn.benchmark = True

    model, ema = make_model(cfg, dist, data.num_classes)
    swa = make_swa(cfg, model, dist)
    train_loader, val_loader = make_loaders(cfg, data, options)
    if (lanes := describe_lanes(train_loader)) is not None:
        log(lanes)
    steps_per_epoch = len(train_loader) // cfg.accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_loader)} batches per epoch is fewer than --accum-steps {cfg.accum_steps}")
    global_batch = cfg.batch_size * dist.world_size * cfg.accum_steps
    lr = cfg.lr * global_batch / 256
    optimizer = build_optimizer(cfg, model, lr)
    factor = warmup_cosine(cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch), cfg.min_lr_ratio)
    if swa is not None:
        factor = swa_schedule(factor, cfg.swa_start * steps_per_epoch, round(cfg.swa_anneal_epochs * steps_per_epoch),
                              cfg.swa_lr / cfg.lr if cfg.swa_lr else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scaler = torch.amp.GradScaler(dist.device.type, enabled=dtype == torch.float16)

    run = Run(cfg, dist, model, optimizer, scheduler, scaler, train_loader, val_loader=val_loader, dtype=dtype,
              ema=ema, swa=swa, classes=data.classes, profiler=make_profiler(cfg, dist), data=contents,
              data_changed=data_changed)
    if resume is not None:
        restore(run, resume)
    if dist.enabled:
        run.train_model = DDP(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    if cfg.compile:
        run.train_model = torch.compile(run.train_model)
    run.run_log = RunLog(Path(cfg.out), dist.is_main, run.state.epoch if resume is not None else None,
                         run.state.step if resume is not None else None)
    if cfg.log_samples:
        run.sample_log = SampleLog(Path(cfg.out), dist)
    where = f", batch {resumed_batches(run.midway, train_loader)} of {len(train_loader)}" if run.midway else ""
    log(f"global batch {global_batch} (lr {lr:.4g}), {steps_per_epoch} steps/epoch, "
        f"{describe_amp(cfg, dtype, dist.device)}, starting at epoch {run.state.epoch}{where}"
        + (", synthetic data (one batch, repeated)" if cfg.synthetic else ""))
    return run


def resumed_batches(midway: dict, loader) -> int:
    """The batches each rank had read of the epoch a mid-epoch checkpoint was saved in."""
    cursor = replace(loader.cursor)  # a copy: the loader is pointed at the checkpoint when its epoch starts
    cursor.load_state_dict(midway["loaders"][0])
    return cursor.batches_done


def log_start(cfg: TrainConfig, dist: Dist, data: ShardData, dtype: torch.dtype | None,
              budget: ThreadBudget, options: tuple) -> None:
    """The run's first lines (the config, the loaders' options, where it trains, on what), and
    RUN/config.json (both configs)."""
    loaders = loader_record(options)
    for source in data.sources:  # first: the files it reads are not in the folder it was given
        if source.manifest.tar_root is not None:
            log(f"--data {source.location}: its manifest reads the tars from {source.manifest.tar_root} (a folder "
                f"indexed with shard-convert index --index-dir)")
    log(f"dali-train config: {json.dumps(cfg.to_json())}")
    log(f"loaders (rank {dist.rank}): {json.dumps(loaders)}")
    log(f"world size {dist.world_size} (ranks from {options[0].ranks_from}), device {dist.device}, "
        f"{describe_amp(cfg, dtype, dist.device)}, {data.num_classes} classes, "
        f"{data.num_samples(cfg.train_split)} train samples")
    log(f"--dali-threads {cfg.workers}: DALI threads per pipeline" if cfg.workers else budget.describe())
    mixed = {}
    if isinstance(cfg.data, list):  # the union's classes, in order, and what each dataset brings
        plan = mix_plan(cfg, data, dist.world_size)
        log(describe_plan(plan, cfg.batch_size))
        mixed = {"classes": data.classes, "mixing": plan}
    if cfg.cache_dir is not None or cfg.cache_limit is not None:
        local = [str(d) for d in (cfg.data if isinstance(cfg.data, list) else [cfg.data]) if not is_s3_url(d)]
        if local:
            log(f"warning: --cache-dir/--cache-limit apply to s3:// data only; {', '.join(local)} is read in place")
    if dist.is_main:
        write_json_atomic(Path(cfg.out) / "config.json", {**cfg.to_json(), **mixed, "loaders": loaders})
    if cfg.val_split is None:
        log("--val-split none: no evaluation; best.pt keeps the epoch of lowest train loss")
    if cfg.warmup_epochs >= cfg.epochs:
        peak = "rises to its peak" if cfg.warmup_epochs == cfg.epochs else "never reaches its peak"
        log(f"warning: --warmup-epochs {cfg.warmup_epochs:g} lasts the whole run (--epochs {cfg.epochs}): the learning "
            f"rate {peak} and never decays")
    if dtype == torch.float16 and dist.device.type == "cpu":
        log("warning: --amp fp16 on the CPU runs about 10x slower than fp32 (PyTorch has few fp16 CPU kernels); "
            "use --amp off, or bf16 on a CPU with AVX-512 BF16 or AMX")


def amp_dtype(cfg: TrainConfig, device: torch.device, capability: tuple[int, int] | None = None) -> torch.dtype | None:
    """Autocast's dtype; None means full precision. `auto`: off on the CPU; on a GPU bf16 where it computes
    bf16 natively (compute capability 8.0 on, `capability`: this device's when None), else fp16 with its
    GradScaler. Not `torch.cuda.is_bf16_supported()`, which by default (`including_emulation=True`) says yes on
    V100 and T4 (sm70/75), where bf16 is emulated and slower than fp16."""
    if cfg.amp == "auto":
        if device.type != "cuda":
            return None
        major, _ = capability or torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[cfg.amp]


def describe_amp(cfg: TrainConfig, dtype: torch.dtype | None, device: torch.device) -> str:
    """`amp bf16`, with what `auto` chose it from on a GPU."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "off"}[dtype]
    if cfg.amp != "auto" or device.type != "cuda":
        return f"amp {name}"
    major, minor = torch.cuda.get_device_capability(device)
    why = "native bf16" if dtype == torch.bfloat16 else "no native bf16: fp16 with a GradScaler"
    return f"amp {name} (auto: sm{major}{minor}, {why})"


def make_model(cfg: TrainConfig, dist: Dist, num_classes: int) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The model on this rank's device, with --pretrained weights loaded, and its --ema average (None without).
    Tensors the weights could not fill (a head of another class count) keep their fresh initialisation."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    try:
        model = models.build_model(cfg.model, num_classes, cfg.width, cfg.image_size)
    except models.ModelError as e:
        raise ConfigError(str(e)) from None
    replaced = checkpoint.load_pretrained(model, cfg.pretrained) if cfg.pretrained else []
    if replaced:
        log(f"--pretrained: re-initialised {', '.join(replaced)} (class count differs)")
    model = model.to(dist.device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    if not cfg.ema:
        return model, None
    # device=: its update count lives beside the weights, where update_ema reads it without a host sync
    return model, torch.optim.swa_utils.AveragedModel(
        model, device=dist.device, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema), use_buffers=True)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW, fused: a fused optimizer takes a `found_inf` flag on the device and leaves weights and state
    untouched when it is set, so a non-finite step is skipped without the host reading whether it is one
    (optimizer_step; GradScaler relies on the same for fp16). Fused kernels exist on CUDA and, since torch
    2.4, on the CPU; the results equal the default (foreach) implementation's to rounding."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return skips_on_device(torch.optim.AdamW(groups, lr=lr, fused=True))
    return skips_on_device(torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                                           nesterov=cfg.nesterov and cfg.momentum > 0, fused=True))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and normalisation weights (every parameter with fewer than 2 dims)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def skips_on_device(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` (built fused, or loaded from a checkpoint) made able to skip any step on the device:
    - fused in every group: `load_state_dict` takes a checkpoint's groups, and one saved before fusing says
      fused False, whose step would refuse `found_inf`;
    - SGD's momentum buffers exist before the first step: fused SGD's first step takes them from
      `torch.empty_like` and fills them, so a skipped first step would leave them uninitialised
      (torch/optim/sgd.py `_fused_sgd`; seen here: 1e18 in a buffer). Zeros give the same first step
      (buffer = momentum x 0 + gradient);
    - AdamW's step counts on the parameter's device in float32, where its fused kernel counts (and a skipped
      step is subtracted again); an unfused checkpoint kept them on the CPU."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None
        for p in group["params"]:
            if "step" in optimizer.state.get(p, {}):
                optimizer.state[p]["step"] = optimizer.state[p]["step"].to(p.device, torch.float32)
            if group.get("momentum") and optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """LR multiplier per optimizer step: linear warm-up from ~0, then cosine down to `min_ratio`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def make_profiler(cfg: TrainConfig, dist: Dist):
    """--profile N: a torch profiler tracing N steps after two (one skipped, one warm-up) into
    RUN/profile_trace.json, on rank 0; None otherwise."""
    if not cfg.profile or not dist.is_main:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dist.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=1, warmup=1, active=cfg.profile, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(Path(cfg.out) / "profile_trace.json")),
    )


def restore(run: Run, saved: dict) -> None:
    """Put the run where the checkpoint `saved` left it: modules, counters, random generators, and the
    position inside an epoch when it was saved mid-epoch."""
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    skips_on_device(run.optimizer)  # a checkpoint's param groups replace the optimizer's, "fused" included
    run.scheduler.load_state_dict(saved["scheduler"])
    run.scaler.load_state_dict(saved["scaler"])
    if run.ema is not None:
        run.ema.load_state_dict(saved["ema"])
    if run.swa is not None and saved.get("swa") is not None:
        run.swa.load_state_dict(saved["swa"])
    run.state = TrainState.from_checkpoint(saved["state"])
    run.midway = saved.get("midway")
    checkpoint.restore_rng(saved["rng"])
