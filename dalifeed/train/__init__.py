"""dali-train: DDP + AMP classification training fed by `dalifeed.pipelines.make_loader`.

Read in this order: `cli.py` (options) -> `resume.resolve_run` (a fresh run, the run in --out continued, or a
refusal) -> `trainer.py`, top to bottom: `main` -> `fit` -> `train_one_epoch` -> `optimizer_step`, then
`build_run` (model, optimiser, schedule, precision). Below it: `evaluation.py` (the validation split's metrics),
`run.py` (`Run`, what the loop uses; checkpoints; metrics.jsonl), `config.py` (TrainConfig), `data.py` (the
shard folders opened and checked, the loaders), `progress.py` (what rank 0 shows while an epoch runs),
`stop.py` (SIGINT/SIGTERM), `mixup.py`, `checkpoint.py`, `distributed.py`.
"""

from typing import TYPE_CHECKING

from dalifeed.lazy import lazy_names

# imported on first use: `dali-train --help` (cli.py, in this package) then reads its options without torch
_WHERE = {
    "ConfigError": ".config", "TrainConfig": ".config", "TrainingDiverged": ".trainer", "TrainResult": ".trainer",
    "evaluate": ".evaluation", "main": ".trainer",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:  # what IDEs and type checkers resolve the lent names to (the same modules as _WHERE)
    from .config import ConfigError as ConfigError
    from .config import TrainConfig as TrainConfig
    from .evaluation import evaluate as evaluate
    from .trainer import TrainingDiverged as TrainingDiverged
    from .trainer import TrainResult as TrainResult
    from .trainer import main as main


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
