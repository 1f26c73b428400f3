"""dali-train: DDP + AMP classification training fed by `dalifeed.pipelines.make_loader`.

Read in this order: `cli.py` (options) -> `resume.resolve_run` (a fresh run, the run in --out continued, or a
refusal) -> `trainer.py`, top to bottom: `main` -> `fit` -> `train_one_epoch` -> `optimizer_step`, then
`build_run` (model, optimiser, schedule, precision). Below it: `evaluate.py` (the validation split's metrics),
`run.py` (`Run`, what the loop uses; checkpoints; metrics.jsonl), `config.py` (TrainConfig), `data.py` (the
shard folders opened and checked, the loaders), `progress.py` (what rank 0 shows while an epoch runs),
`stop.py` (SIGINT/SIGTERM), `mixup.py`, `checkpoint.py`, `distributed.py`.
"""

from .config import ConfigError, TrainConfig
from .evaluate import evaluate
from .trainer import TrainingDiverged, TrainResult, main, train_one_epoch

__all__ = ["ConfigError", "TrainConfig", "TrainingDiverged", "TrainResult", "evaluate", "main", "train_one_epoch"]
