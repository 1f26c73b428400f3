"""The run, in the order it happens: `main(cfg)` locks the run folder, `build_run` assembles the `Run` (data,
model, optimiser, schedule, precision, restored from a checkpoint when resuming), `fit` drives its epochs:
`train_one_epoch` and `validation_record` (loop.py), a metrics line and a checkpoint (`Run.finish_epoch`,
run.py).
Only rank 0 prints and writes. Single process or under torchrun, CPU (gloo) or GPU (NCCL). SIGINT and SIGTERM
stop every rank after the same step (the next check, within about 2 s), with a mid-epoch checkpoint (stop.py). Whether a command starts a run or
continues one is `resume.resolve_run`'s decision, made before `main`."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dalifeed.atomic import write_json_atomic
from dalifeed.cliutil import folder_not_created
from dalifeed.nvml import gpu_stats
from dalifeed.pipelines import ThreadBudget, thread_budget
from dalifeed.pipelines.dataset import Dataset
from dalifeed.runtime import DiskFull, folder_lock, is_disk_full
from dalifeed.s3 import is_s3_url

from . import checkpoint, models
from .config import ConfigError, TrainConfig
from .distributed import Dist, log, setup, teardown
from .loop import train_one_epoch, validation_record
from .mixdata import describe_plan, mix_plan
from .data import loader_device, loader_options, loader_record, make_loaders, open_data
from .progress import RunLog
from .run import Run
from .state import TrainState
from .stop import TrainingStopped


@dataclass
class TrainResult:
    metrics: dict  # the last epoch's record, as in metrics.jsonl
    model: torch.nn.Module  # this rank's trained model, unwrapped from DDP/compile


def main(cfg: TrainConfig, resume: dict | None = None) -> TrainResult:
    """Train `cfg`; `resume` is the checkpoint to continue from (`resolve_run` chose both). Rank 0 holds RUN's
    lock throughout."""
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
# building the run


def build_run(cfg: TrainConfig, dist: Dist, resume: dict | None) -> Run:
    """Data, model, optimiser, schedule and precision for `cfg` on this process; restored from `resume`."""
    data = open_data(cfg, dist)  # --data opened once: kind, splits and batch checked
    if resume is not None and resume["classes"] != data.classes:
        raise ConfigError(f"{cfg.out}: checkpoint was trained on other classes than {cfg.data} holds")
    dtype = amp_dtype(cfg, dist.device)
    budget = thread_budget(loader_device(cfg, dist))
    options = loader_options(cfg, dist, threads=cfg.workers or budget.threads)
    log_start(cfg, dist, data, dtype, budget, options)
    if dist.device.type == "cuda":
        # every batch has the same shape (--image-size): cuDNN times its algorithms once per layer shape in
        # the first steps and keeps the fastest (gpu-check leaves the first epoch out for it)
        torch.backends.cudnn.benchmark = True

    model, ema = make_model(cfg, dist, data.num_classes)
    train_loader, val_loader = make_loaders(cfg, data, options)
    steps_per_epoch = len(train_loader) // cfg.accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_loader)} batches per epoch is fewer than --accum-steps {cfg.accum_steps}")
    global_batch = cfg.batch_size * dist.world_size * cfg.accum_steps
    lr = cfg.lr * global_batch / 256
    optimizer = build_optimizer(cfg, model, lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(
        cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch), cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler(dist.device.type, enabled=dtype == torch.float16)

    run = Run(cfg, dist, model, optimizer, scheduler, scaler, train_loader, val_loader=val_loader, dtype=dtype,
              ema=ema, classes=data.classes, profiler=make_profiler(cfg, dist))
    if resume is not None:
        restore(run, resume)
    if dist.enabled:
        run.train_model = DDP(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    if cfg.compile:
        run.train_model = torch.compile(run.train_model)
    run.run_log = RunLog(Path(cfg.out), dist.is_main, run.state.epoch if resume is not None else None,
                         run.state.step if resume is not None else None)
    where = f", batch {resumed_batches(run.midway, train_loader)} of {len(train_loader)}" if run.midway else ""
    log(f"global batch {global_batch} (lr {lr:.4g}), {steps_per_epoch} steps/epoch, amp {dtype or 'off'}, "
        f"starting at epoch {run.state.epoch}{where}" + (", synthetic data (one batch, repeated)" if cfg.synthetic else ""))
    return run


def resumed_batches(midway: dict, loader) -> int:
    """The batches each rank had read of the epoch a mid-epoch checkpoint was saved in."""
    cursor = replace(loader.cursor)  # a copy: the loader is pointed at the checkpoint when its epoch starts
    cursor.load_state_dict(midway["loaders"][0])
    return cursor.batches_done


def log_start(cfg: TrainConfig, dist: Dist, data: Dataset, dtype: torch.dtype | None,
              budget: ThreadBudget, options: tuple) -> None:
    """The run's first lines (the config, the loaders' options, where it trains, on what), and
    RUN/config.json (both configs)."""
    loaders = loader_record(options)
    log(f"dali-train config: {json.dumps(cfg.to_json())}")
    log(f"loaders (rank {dist.rank}): {json.dumps(loaders)}")
    log(f"world size {dist.world_size}, device {dist.device}, {data.num_classes} classes, "
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
    if dtype == torch.float16 and dist.device.type == "cpu":
        log("warning: --amp fp16 on the CPU runs about 10x slower than fp32 (PyTorch has few fp16 CPU kernels); "
            "use --amp off, or bf16 on a CPU with AVX-512 BF16 or AMX")


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """Autocast's dtype; None means full precision."""
    if cfg.amp == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[cfg.amp]


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
    # device=: its update count lives beside the weights, where loop.update_ema reads it without a host sync
    return model, torch.optim.swa_utils.AveragedModel(
        model, device=dist.device, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema), use_buffers=True)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW, fused: a fused optimizer takes a `found_inf` flag on the device and leaves weights and state
    untouched when it is set, so a non-finite step is skipped without the host reading whether it is one
    (loop.optimizer_step; GradScaler relies on the same for fp16). Fused kernels exist on CUDA and, since torch
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
    run.state = TrainState.from_checkpoint(saved["state"])
    run.midway = saved.get("midway")
    checkpoint.restore_rng(saved["rng"])


# ----------------------------------------------------------------------------------------------------
# running it


def fit(run: Run) -> TrainResult:
    """The epochs: train, evaluate, record, checkpoint; stop cleanly when a signal asks."""
    cfg, state, stop = run.cfg, run.state, run.stop
    record: dict = {}
    if state.epoch >= cfg.epochs:
        log(f"{run.out}: this run has finished all {cfg.epochs} epochs; nothing to do (raise --epochs to go on)")
    with run.profiler or nullcontext(), stop.listening():
        for epoch in range(state.epoch, cfg.epochs):
            state.epoch = epoch
            stats = train_one_epoch(run, run.start_epoch(epoch))
            if stop.agreed and stats.steps < run.steps_per_epoch:
                raise TrainingStopped(stop.agreed, run.where(f"epoch {epoch}, step {stats.steps} of "
                                                             f"{run.steps_per_epoch}"))
            record = {"epoch": epoch, "lr": run.optimizer.param_groups[0]["lr"], "train_loss": stats.loss,
                      "images_per_s": stats.images * run.dist.world_size / stats.seconds,
                      "epoch_seconds": stats.seconds, "data_wait_share": stats.data_wait / stats.seconds,
                      "bad_steps": stats.bad_steps}
            record.update(validation_record(run))
            record.update(gpu_stats(run.dist.device))
            state.epoch = epoch + 1
            run.finish_epoch(record)
            if stop.agreed or stop.requested and not run.dist.enabled:
                raise TrainingStopped(stop.agreed or stop.requested, run.where(f"the end of epoch {epoch}"))
    run.run_log.close()
    return TrainResult(record, run.model)
