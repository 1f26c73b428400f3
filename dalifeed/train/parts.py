"""The parts `trainer.build_run` assembles, each from the config alone: the
model, the optimiser, the learning-rate schedule, the precision, the profiler."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import checkpoint, models
from .config import ConfigError, TrainConfig
from .distributed import Dist


def build_model(cfg: TrainConfig, num_classes: int) -> tuple[torch.nn.Module, list[str]]:
    """The model, with --pretrained weights loaded; also the names of the tensors those could not fill (a head
    of another class count), which keep their fresh initialisation."""
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
    """SGD or AdamW, fused: a fused optimizer takes a `found_inf` flag on the device and leaves weights and state
    untouched when it is set, so a non-finite step is skipped without the host reading whether it is one
    (loop.optimizer_step; GradScaler relies on the same for fp16). Fused kernels exist on CUDA and, since torch
    2.4, on the CPU; the results equal the default (foreach) implementation's to rounding."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return skips_on_device(torch.optim.AdamW(groups, lr=lr, fused=True))
    return skips_on_device(torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                                           nesterov=cfg.nesterov and cfg.momentum > 0, fused=True))


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
