"""--swa-start: stochastic weight averaging (Izmailov et al. 2018, torch.optim.swa_utils). From epoch
`--swa-start` on the learning rate goes to `--swa-lr` (`swa_schedule`, SWALR's cosine anneal over
`--swa-anneal-epochs`, then constant), the weights are averaged after every epoch (`AveragedModel`, its equal
weights), and after the last epoch the average's BatchNorm statistics are recomputed over the training data
(`update_bn`, torch's `update_bn` with autocast and every rank's share), the average is evaluated
(`swa_top1`, `swa_top5`, `swa_val_loss` in the last metrics line) and saved as RUN/swa.pt.

Nothing here runs inside a step: the average moves once an epoch, so no step waits for the device."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from .distributed import Dist, all_reduce_sum, log
from .evaluation import autocast

SWA = "swa.pt"


def make_swa(cfg, model: torch.nn.Module, dist: Dist) -> torch.optim.swa_utils.AveragedModel | None:
    """The equal-weight average of `model` (None without --swa-start); its count lives on the device."""
    if cfg.swa_start is None:
        return None
    return torch.optim.swa_utils.AveragedModel(model, device=dist.device)


def swa_schedule(factor: Callable[[int], float], swa_step: int, anneal_steps: int,
                 swa_ratio: float | None) -> Callable[[int], float]:
    """The LR multiplier per optimizer step with SWA: `factor` until step `swa_step`, then from the value it had
    there to `swa_ratio` (--swa-lr / --lr) by SWALR's cosine over `anneal_steps`, then constant. Without
    --swa-lr (`swa_ratio` None) the schedule is left as it is."""
    if swa_ratio is None:
        return factor
    start = factor(swa_step)

    def with_swa(step: int) -> float:
        if step < swa_step:
            return factor(step)
        if step + 1 >= swa_step + anneal_steps:
            return swa_ratio
        t = (step - swa_step + 1) / anneal_steps
        alpha = (1 - math.cos(math.pi * t)) / 2
        return start * (1 - alpha) + swa_ratio * alpha
    return with_swa


@torch.no_grad()
def update_bn(module: torch.nn.Module, loader, dist: Dist, dtype: torch.dtype | None, channels_last: bool,
              epoch: int) -> int:
    """torch.optim.swa_utils.update_bn for a DALI loader on every rank: each BatchNorm's running statistics
    reset and recomputed as the plain mean over one pass of the training data, in the epoch `epoch`'s order
    and image size (the last one trained: --progressive-resize's final size), then averaged over the ranks,
    whose shares of the epoch are the same number of batches. Returns the batches this rank read.

    torch's `momentum=None` makes every BatchNorm forward read its `num_batches_tracked` on the host
    (torch/nn/modules/batchnorm.py, `1.0 / float(self.num_batches_tracked)`); the same factor, 1/j before a
    layer's j-th call of the pass (a layer applied twice a batch is counted twice, as torch counts it), is set
    here from a host counter, so the pass reads nothing from the device. The loader is pointed at `epoch` for
    this one pass (`ahead=False`): it starts nothing of a next epoch during it. The momenta and the mode are
    restored also when the pass fails."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return 0
    momenta = [m.momentum for m in norms]
    calls = dict.fromkeys(norms, 0)

    def cumulative(norm, _inputs) -> None:  # the cumulative mean's weight torch computes from the layer's count
        calls[norm] += 1
        norm.momentum = 1.0 / calls[norm]

    hooks = [m.register_forward_pre_hook(cumulative) for m in norms]
    for m in norms:
        m.reset_running_stats()
    training = module.training
    module.train()
    batches = 0
    try:
        loader.set_epoch(epoch, ahead=False)
        for images, _ in loader:
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast(dist, dtype):
                module(images)
            batches += 1
    finally:
        for hook in hooks:
            hook.remove()
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        module.train(training)
    if dist.enabled:
        for m in norms:
            if m.running_mean is not None:  # a layer with track_running_stats=False keeps none
                m.running_mean.copy_(all_reduce_sum(m.running_mean) / dist.world_size)
                m.running_var.copy_(all_reduce_sum(m.running_var) / dist.world_size)
    return batches


def finish_swa(run, measure: Callable[[torch.nn.Module], dict]) -> dict:
    """After the last epoch: the average's BatchNorm statistics, then its metrics, prefixed swa_."""
    cfg = run.cfg
    batches = update_bn(run.swa.module, run.train_loader, run.dist, run.dtype, cfg.channels_last, cfg.epochs - 1)
    log(f"SWA: the average of {int(run.swa.n_averaged)} epochs ({cfg.swa_start} to {cfg.epochs - 1}); BatchNorm "
        f"statistics recomputed over {batches} training batches per process")
    record = measure(run.swa.module) if run.val_loader is not None else {}
    return {f"swa_{name}": v for name, v in record.items() if name != "val_samples"}


def swa_payload(run, metrics: dict) -> dict:
    """RUN/swa.pt: the averaged weights as `model` (what --pretrained and checkpoint.load read), the classes,
    the config, the average's metrics and how many epochs it holds: nothing timed, so that a resumed run
    writes the same bytes as an uninterrupted one."""
    kept = {k: v for k, v in metrics.items() if k.startswith("swa_") or k == "epoch"}
    return {"model": run.swa.module.state_dict(), "classes": run.classes, "config": run.cfg.to_json(),
            "metrics": kept, "swa": {"start": run.cfg.swa_start, "epochs_averaged": int(run.swa.n_averaged)}}


def swa_path(out: str) -> Path:
    return Path(out) / SWA
