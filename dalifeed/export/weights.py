"""What `dalifeed export` takes from a dali-train run folder: the checkpoint of the weights asked for, the run's
config and classes as that checkpoint saved them, the classifier rebuilt with those weights, and the top-1 the
run recorded for them (`RunWeights`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dalifeed.train import checkpoint
from dalifeed.train.config import ConfigError, TrainConfig
from dalifeed.train.swa import SWA

from .config import WEIGHTS, ExportError


@dataclass
class RunWeights:
    """One set of weights of a run, with what the run knows about them.

    Attributes:
        run: The run folder.
        weights: Which weights: best (best.pt), last (last.pt), ema (last.pt's EMA average) or swa (swa.pt).
        file: The checkpoint they come from.
        config: The run's `TrainConfig`, as that checkpoint saved it.
        classes: The class names, in label order (the manifest's).
        state: The model's state_dict.
        top1: The validation top-1 the run recorded for these weights (None: not evaluated, or a mid-epoch
            last.pt).
        epoch: The epoch whose end the checkpoint was saved at (None: mid-epoch).
    """

    run: Path
    weights: str
    file: Path
    config: TrainConfig
    classes: list[str]
    state: dict
    top1: float | None
    epoch: int | None

    def model(self) -> torch.nn.Module:
        """The classifier with these weights, in eval mode, on the CPU."""
        from dalifeed.train import models

        cfg = self.config
        model = models.build_model(cfg.model, len(self.classes), cfg.width, cfg.image_size)
        model.load_state_dict(self.state)
        return model.eval()


def default_weights(run: Path) -> str:
    """The weights a run reports as its result: the SWA average when the run finished with one, else the best
    epoch's, else the last checkpoint's."""
    if (run / SWA).is_file():
        return "swa"
    return "best" if (run / checkpoint.BEST).is_file() else "last"


def load_run_weights(run: str | Path, weights: str | None = None) -> RunWeights:
    """One set of weights of a dali-train run, with what the run recorded for them.

    Args:
        run: The run folder (dali-train's `--out`).
        weights: `"best"`, `"last"`, `"ema"` or `"swa"`; None: what the run reports as its result (swa.pt when
            it finished with SWA, else best.pt, else last.pt). Default None.

    Returns:
        A `RunWeights`: the model's state_dict, the run's config and classes, and the recorded top-1.

    Raises:
        ExportError: The folder holds no checkpoint or not these weights, or the run is multilabel.
    """
    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"RUN_DIR {run}: {'is a file, not' if run.exists() else 'no such'} run folder")
    saved = [name for name in (checkpoint.LAST, checkpoint.BEST, SWA) if (run / name).is_file()]
    if not saved:
        raise ExportError(f"RUN_DIR {run}: not a dali-train run folder with a checkpoint (no {checkpoint.LAST}, "
                          f"{checkpoint.BEST} or {SWA})")
    weights = weights or default_weights(run)
    if weights not in WEIGHTS:
        raise ExportError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    file = run / {"best": checkpoint.BEST, "swa": SWA}.get(weights, checkpoint.LAST)
    if not file.is_file():
        raise ExportError(f"--weights {weights}: {run} has no {file.name} (it has {', '.join(saved)})")
    try:
        payload = checkpoint.load(file)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    config = TrainConfig.from_json(payload["config"])
    if config.task == "multilabel":
        raise ExportError(f"RUN_DIR {run}: a multilabel run (COCO shards, scored by mAP); dalifeed export takes "
                          f"classification runs only")
    metrics = payload.get("metrics") or {}
    state, top1 = payload["model"], metrics.get("top1")
    if weights == "ema":
        if payload.get("ema") is None:
            raise ExportError(f"--weights ema: the run in {run} kept no EMA average (it trained without --ema)")
        state, top1 = averaged_state(payload["ema"]), metrics.get("ema_top1")
    elif weights == "swa":
        top1 = metrics.get("swa_top1")
    epoch = metrics.get("epoch")
    return RunWeights(run=run, weights=weights, file=file, config=config, classes=list(payload["classes"]),
                      state=state, top1=top1, epoch=epoch)


def averaged_state(averaged: dict) -> dict:
    """The model's state_dict inside a torch `AveragedModel`'s (its `module.` prefix off, its count dropped)."""
    prefix = "module."
    return {k.removeprefix(prefix): v for k, v in averaged.items() if k.startswith(prefix)}
