"""After each epoch: the validation split's metrics (`validation_record`, which `trainer.fit` adds to the
epoch's metrics line), counted over exactly the whole split on every rank: `evaluate` (loss, top-1, top-5)
and `evaluate_multilabel` (loss, mAP). `autocast` is the one mixed-precision switch, the training step's too."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from .data import evaluate_each
from .distributed import Dist, all_reduce_sum, gather_objects
from .run import Run


def validation_record(run: Run) -> dict:
    """The validation split's metrics for the epoch's metrics line (none with --val-split none): the model's,
    and with --ema the averaged weights' too, prefixed ema_."""
    if run.val_loader is None:
        return {}
    measure = measurer(run)
    record = measure(run.train_model)
    if run.ema is not None:
        ema = measure(run.ema.module)
        record.update({f"ema_{name}": v for name, v in ema.items() if name != "val_samples"})
    return record


def measurer(run: Run):
    """model -> the validation split's metrics for this run's task (and each dataset's, mixed)."""
    if run.cfg.task == "multilabel":
        return lambda model: evaluate_multilabel(model, run.val_loader, run.dist, run.dtype)

    def measure(model):
        if hasattr(run.val_loader, "per_dataset"):  # several datasets (--data A --data B): each apart
            return evaluate_each(lambda part: evaluate(model, part, run.dist, run.dtype, len(run.classes)),
                                 run.val_loader)
        return evaluate(model, run.val_loader, run.dist, run.dtype, len(run.classes))
    return measure


def autocast(dist: Dist, dtype: torch.dtype | None):
    """Mixed precision in `dtype`; None: full precision."""
    return torch.autocast(dist.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Iterable, device: torch.device | str | Dist,
             dtype: torch.dtype | None = None, num_classes: int = 1000) -> dict:
    """Loss, top-1 and top-5 accuracy of `model` over exactly the whole split `loader` reads.

    Every rank counts its own samples and the sums are all-reduced over the process group when one is
    initialised, so every rank returns the whole split's figures; a `make_loader` validation loader hands
    each sample to exactly one rank and never yields padding.

    Args:
        model: The classifier, called on each batch of images; put in eval mode.
        loader: Yields (images, labels) batches on `device`, e.g. `make_loader(..., "val", ...)`.
        device: Where the sums are kept: the device the batches arrive on (`torch.device("cuda", 0)`,
            `"cpu"`).
        dtype: Autocast's dtype (`torch.bfloat16`, `torch.float16`); None: full precision. Default None.
        num_classes: The model's class count; top-5 is top-k with k = min(5, num_classes). Default 1000.

    Returns:
        `{"val_loss": mean cross-entropy, "top1": fraction, "top5": fraction, "val_samples": count}`.
    """
    model.eval()
    device = device.device if isinstance(device, Dist) else torch.device(device)
    k = min(5, num_classes)
    totals = torch.zeros(4, device=device, dtype=torch.float64)  # loss sum, top1, topk, count
    for images, labels in loader:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
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
