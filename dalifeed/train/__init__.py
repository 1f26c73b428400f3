"""dali-train: DDP + AMP classification training fed by `dalifeed.pipelines.make_loader`."""

from .config import ConfigError, TrainConfig
from .trainer import TrainingDiverged, TrainResult, evaluate, main, train_one_epoch

__all__ = ["ConfigError", "TrainConfig", "TrainingDiverged", "TrainResult", "evaluate", "main", "train_one_epoch"]
