"""`dalifeed export RUN_DIR REPO`: a Triton model repository from a dali-train run, preprocessed as the run was
validated (docs/serving.md).

    from dalifeed.export import ExportConfig, export_repository
    export_repository(ExportConfig(run="runs/r50", repo="models", weights="best", device="gpu"))

Read in this order: `cli.py` (options) -> `repository.export_repository` (the DALI model, the ONNX classifier,
the ensemble) -> `weights.py` (which checkpoint, which weights, what the run recorded for them) and `triton.py`
(each config.pbtxt and the README). `config.py` holds `ExportConfig`.
"""

from typing import TYPE_CHECKING

from dalifeed.lazy import lazy_names

# imported on first use: `dalifeed export --help` (cli.py, in this package) reads its options without DALI or torch
_WHERE = {
    "ExportConfig": ".config", "ExportError": ".config", "export_repository": ".repository",
    "serving_pipeline": ".repository", "serialized_pipeline": ".repository", "RunWeights": ".weights",
    "load_run_weights": ".weights",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:  # what IDEs and type checkers resolve the lent names to (the same modules as _WHERE)
    from .config import ExportConfig as ExportConfig
    from .config import ExportError as ExportError
    from .repository import export_repository as export_repository
    from .repository import serialized_pipeline as serialized_pipeline
    from .repository import serving_pipeline as serving_pipeline
    from .weights import RunWeights as RunWeights
    from .weights import load_run_weights as load_run_weights


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
