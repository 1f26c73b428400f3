"""`export_repository`: a dali-train run folder -> a Triton model repository (`ExportConfig` says which run,
which weights, where, for which device). The DALI model is the run's validation graph (`graphs.val_transform`,
the function the evaluation loader runs) fed by `fn.external_source` instead of the shard reader; the classifier
is ONNX; an ensemble wires the two (triton.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.data_node import DataNode

from dalifeed.atomic import write_atomic, write_json_atomic
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.pipelines.graphs import Output, val_transform
from dalifeed.pipelines.serialized import without_origins

from . import triton
from .config import EXPORT_RECORD, ExportConfig, ExportError
from .weights import RunWeights, load_run_weights

ONNX_OPSET = 17


@pipeline_def(enable_conditionals=False)
def serving_pipeline(augment: AugmentConfig, device: str) -> DataNode:
    """The validation graph on encoded images fed by name (`DALI_INPUT_0`), as DALI's Triton backend feeds
    them: float32 CHW out, the evaluation loader's dtype and layout.

    A `@pipeline_def`: call it with DALI's `Pipeline` keywords (`batch_size`, `num_threads`, `device_id`) too.

    Args:
        augment: The run's validation preprocessing (resize, crop, mean and std, size).
        device: `"cpu"`, or `"gpu"` for nvJPEG decoding and GPU operators.

    Returns:
        The graph's one output, the images, float32 (3, H, W); called, the `@pipeline_def` gives a DALI
        `Pipeline` of that output.
    """
    encoded = fn.external_source(name=triton.DALI_INPUT, dtype=types.UINT8, ndim=1, device="cpu")
    return val_transform(encoded, augment, device, Output())


def serialized_pipeline(augment: AugmentConfig, device: str, batch_size: int, num_threads: int) -> bytes:
    """`serving_pipeline` serialized (DALI's protobuf), without the Python lines it was defined at. Made with no
    device_id, so that a GPU graph serializes on a machine without one: the backend builds it with its own
    batch size, threads and GPU.

    Args:
        augment: The run's validation preprocessing.
        device: `"cpu"` or `"gpu"`.
        batch_size: The largest batch, Triton's `max_batch_size`.
        num_threads: DALI's CPU threads.

    Returns:
        The bytes of `model.dali`.
    """
    pipe = serving_pipeline(augment, device, batch_size=batch_size, num_threads=num_threads, device_id=None)
    return without_origins(pipe.serialize())


def write_onnx(model: torch.nn.Module, size: int, path: Path) -> None:
    """`model` as ONNX (opset ONNX_OPSET) at `path`: input `images` (N, 3, size, size) float32, output `logits`,
    N dynamic. The TorchScript exporter (dynamo=False), which needs no onnxscript; torch marks it deprecated."""
    example = torch.zeros(1, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=ONNX_OPSET,
                          input_names=[triton.ONNX_INPUT], output_names=[triton.ONNX_OUTPUT],
                          dynamic_axes={triton.ONNX_INPUT: {0: "batch"}, triton.ONNX_OUTPUT: {0: "batch"}})


def export_repository(cfg: ExportConfig, log: Callable[[str], object] = print) -> dict:
    """Write the Triton model repository `cfg.repo` from the dali-train run `cfg.run`.

    The repository is written beside REPO and renamed into place, so that REPO is the earlier export or this
    one, never a mix.

    Args:
        cfg: What to export and how: the run, the repository, the weights, the device, the names and sizes.
        log: Called with each line of progress. Default `print`.

    Returns:
        The record saved as REPO/export.json: the options, the weights and checkpoint exported, the top-1 the
        run recorded for them, the versions.

    Raises:
        ExportError: A folder that is not a run with a checkpoint, weights it does not have, a multilabel
            run, a REPO holding other files, or no `onnx` package.
    """
    cfg.validate()
    try:  # torch.onnx.export needs it, and says so only once the graph is traced
        import onnx  # noqa: F401
    except ImportError:
        raise ExportError("dalifeed export writes the classifier with torch.onnx, which needs the onnx package: "
                          "pip install 'dalifeed[export]' (or pip install onnx)") from None
    found = load_run_weights(cfg.run, cfg.weights)
    log(f"dalifeed export config: {json.dumps(asdict(cfg))}")
    run_cfg = found.config
    augment = run_cfg.val_augment()
    tensors = triton.Tensors(name=cfg.name, size=augment.image_size, classes=len(found.classes),
                             max_batch_size=cfg.max_batch_size, gpu=cfg.device == "gpu")
    saved_at = "mid-epoch" if found.epoch is None else f"epoch {found.epoch}"
    log(f"{found.run}: {found.weights} weights ({found.file.name}, {saved_at}), {run_cfg.model}, "
        f"{tensors.classes} classes, validation at {augment.image_size} px after a resize to "
        f"{augment.val_shorter_side}")
    record = exported_record(cfg, found, augment, tensors)
    repo = Path(cfg.repo)
    repo.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.tmp-", dir=repo.parent))
    try:
        write_models(staging, cfg, found, augment, tensors, record)
        if repo.exists():
            shutil.rmtree(repo)
        staging.rename(repo)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {repo}: {tensors.name} (ensemble), {tensors.preprocess} (DALI), {tensors.classifier} (ONNX); "
        f"serve it as {repo / 'README.md'} says")
    return record


def exported_record(cfg: ExportConfig, found: RunWeights, augment: AugmentConfig, tensors: triton.Tensors) -> dict:
    """REPO/export.json: the options, which weights of which checkpoint, what the run recorded for them, the
    preprocessing's numbers and the versions that wrote the models."""
    import nvidia.dali

    return {"config": asdict(cfg), "weights": found.weights, "checkpoint": found.file.name, "epoch": found.epoch,
            "top1": found.top1, "amp": found.config.amp, "model": found.config.model, "classes": found.classes,
            "image_size": augment.image_size, "resize": augment.val_shorter_side, "mean": list(augment.mean),
            "std": list(augment.std), "dali": nvidia.dali.__version__, "torch": torch.__version__,
            "models": {"ensemble": tensors.name, "dali": tensors.preprocess, "onnx": tensors.classifier}}


def write_models(root: Path, cfg: ExportConfig, found: RunWeights, augment: AugmentConfig,
                 tensors: triton.Tensors, record: dict) -> None:
    """The three model folders, the README and export.json, into `root`."""
    labels = "".join(f"{name}\n" for name in found.classes).encode()
    dali_dir, onnx_dir, ensemble_dir = root / tensors.preprocess, root / tensors.classifier, root / tensors.name
    for folder in (dali_dir, onnx_dir, ensemble_dir):
        (folder / "1").mkdir(parents=True)  # an ensemble too needs a version folder, empty
    write_atomic(dali_dir / "1" / "model.dali",
                 serialized_pipeline(augment, cfg.device, cfg.max_batch_size, cfg.dali_threads))
    write_atomic(dali_dir / "config.pbtxt", triton.dali_config(tensors, cfg.dali_threads).encode())
    write_onnx(found.model(), augment.image_size, onnx_dir / "1" / "model.onnx")
    write_atomic(onnx_dir / "config.pbtxt", triton.onnx_config(tensors).encode())
    write_atomic(onnx_dir / triton.LABELS, labels)
    write_atomic(ensemble_dir / "config.pbtxt", triton.ensemble_config(tensors).encode())
    write_atomic(ensemble_dir / triton.LABELS, labels)
    write_atomic(root / "README.md", triton.readme(tensors, run=str(found.run), weights=found.weights,
                                                   top1=found.top1, dali_version=record["dali"],
                                                   triton=cfg.triton_release).encode())
    write_json_atomic(root / EXPORT_RECORD, record)
