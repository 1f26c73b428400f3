"""dali-train: DDP + AMP classification training fed by `dalifeed.pipelines.make_loader`.

Read in this order: `cli.py` (options) -> `resume.resolve_run` (a fresh run, the run in --out continued, or a
refusal) -> `trainer.main` (build the run: model, optimiser, schedule, precision; fit its epochs) ->
`loop.train_one_epoch` / `optimizer_step` / `evaluate`, with `run.Run` (what the loop uses; checkpoints).
Beside them: `config.py` (TrainConfig), `data.py` (the shard folders opened and checked, the loaders),
`progress.py` (what rank 0 shows and writes), `stop.py` (SIGINT/SIGTERM), `checkpoint.py`, `distributed.py`.
"""

from .config import ConfigError, TrainConfig
from .loop import TrainingDiverged, evaluate, train_one_epoch
from .trainer import TrainResult, main

__all__ = ["ConfigError", "TrainConfig", "TrainingDiverged", "TrainResult", "evaluate", "main", "train_one_epoch"]
