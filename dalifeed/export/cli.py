"""`dalifeed export RUN_DIR REPO`: the click command; its options are `ExportConfig`'s fields. DALI and torch are
imported when it runs, not by `dalifeed --help`."""

from __future__ import annotations

from pathlib import Path

import click

from dalifeed.cliutil import default, run_command
from dalifeed.entry import dali_import_error, exit_without_dali
from dalifeed.runtime import DiskFull

from .config import DEVICES, WEIGHTS, ExportConfig, ExportError


def d(name: str):
    return default(ExportConfig, name)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--weights", type=click.Choice(WEIGHTS), default=None,
              help="Which weights: best (best.pt), last (last.pt), ema (last.pt's EMA average), swa (swa.pt). "
                   "Default: what the run reports as its result, swa.pt if the run finished with SWA, else best.pt "
                   "(last.pt when the run has no best.pt yet).")
@click.option("--device", type=click.Choice(DEVICES), default=d("device"), show_default=True,
              help="Where Triton runs the models: gpu (the DALI model decodes with nvJPEG; KIND_GPU) or cpu "
                   "(KIND_CPU).")
@click.option("--name", default=d("name"), show_default=True,
              help="The ensemble's name, what clients call; the models are NAME_preprocess and NAME_onnx.")
@click.option("--max-batch-size", type=int, default=d("max_batch_size"), show_default=True,
              help="Triton's largest batch for each model.")
@click.option("--dali-threads", type=int, default=d("dali_threads"), show_default=True,
              help="CPU threads of the DALI model.")
@click.option("--triton-release", default=d("triton_release"), show_default=True, metavar="YY.MM",
              help="The release of nvcr.io/nvidia/tritonserver that REPO/README.md's commands name; its DALI backend "
                   "must run this DALI's version or newer (the README says how to see which it runs).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def export(run_dir: Path, repo: Path, debug: bool, **options) -> None:
    """Write a Triton model repository REPO from the dali-train run in RUN_DIR.

    \b
    REPO/NAME_preprocess/1/model.dali   the run's validation graph (decode, resize, centre crop, normalise),
                                        fed the request's encoded image bytes (JPEG, PNG, ...)
    REPO/NAME_onnx/1/model.onnx         the classifier, dynamic batch, with labels.txt of the run's classes
    REPO/NAME/config.pbtxt              the ensemble clients call: IMAGE (UINT8 [-1]) -> LOGITS
    REPO/README.md                      the docker run and perf_analyzer commands; REPO/export.json

    Exit codes: 0 done; 2 usage (a folder that is not a run with a checkpoint, weights it does not have, a
    multilabel run, a REPO holding other files); 1 a runtime failure (a full disk).
    """
    cfg = ExportConfig(run=str(run_dir), repo=str(repo), **options)

    def body() -> None:
        if (error := dali_import_error()) is not None:
            exit_without_dali(error)
        from .repository import export_repository

        export_repository(cfg, log=click.echo)

    run_command(body, debug=debug, usage_errors=(ExportError,), runtime_errors=(DiskFull,))
