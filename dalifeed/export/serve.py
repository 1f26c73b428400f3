"""`dalifeed serve RUN_DIR --python PY`: the run exported for the CPU into a temporary folder, then served by
PyTriton (pytriton_server.py) in the Python `PY` names, a separate environment: PyTriton 0.7 pins numpy < 2,
which the training stack's environment does not have (docs/serving.md, "Serve it without a GPU")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from dalifeed.cliutil import run_command
from dalifeed.entry import dali_import_error, exit_without_dali
from dalifeed.runtime import DiskFull

from .config import WEIGHTS, ExportConfig, ExportError


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--python", "python", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The Python of the serving environment: nvidia-pytriton, nvidia-dali, onnxruntime, numpy < 2.")
@click.option("--weights", type=click.Choice(WEIGHTS), default=None, help="As dalifeed export's --weights.")
@click.option("--max-batch-size", type=int, default=32, show_default=True, help="The dynamic batcher's largest.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def serve(run_dir: Path, python: Path, weights: str | None, max_batch_size: int, http_port: int, grpc_port: int,
          metrics_port: int, debug: bool) -> None:
    """Serve the dali-train run in RUN_DIR over HTTP and gRPC on this machine's CPU, with PyTriton: the model
    named `classifier` takes IMAGE (one encoded image per sample, as bytes) and answers LOGITS, preprocessed by
    the run's validation graph as `dalifeed export` writes it. Ctrl-C stops it."""
    with tempfile.TemporaryDirectory(prefix="dalifeed-serve-") as tmp:
        repo = Path(tmp) / "repo"
        cfg = ExportConfig(run=str(run_dir), repo=str(repo), weights=weights, device="cpu",
                           max_batch_size=max_batch_size)

        def body() -> None:
            if (error := dali_import_error()) is not None:
                exit_without_dali(error)
            from .repository import export_repository

            export_repository(cfg, log=click.echo)

        run_command(body, debug=debug, usage_errors=(ExportError,), runtime_errors=(DiskFull,))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_path(Path(tmp)),
                                                                         os.environ.get("PYTHONPATH")]))}
        command = [str(python), "-m", "dalifeed.export.pytriton_server", str(repo), "--http-port", str(http_port),
                   "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
        server = subprocess.Popen(command, env=env, preexec_fn=default_signals)
        # Ctrl-C reaches the server too, which stops itself; a SIGTERM to this process is passed on to it
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: server.terminate())}
        try:
            code = server.wait()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    sys.exit(code)


def package_path(tmp: Path) -> str:
    """A folder in `tmp` that holds dalifeed alone (a link to this package), for the serving environment's
    PYTHONPATH: it has no dalifeed installed, and the folder this package stands in may be the training
    environment's site-packages, whose numpy 2 and torch must not shadow its own."""
    folder = tmp / "path"
    folder.mkdir()
    (folder / "dalifeed").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    return str(folder)


def default_signals() -> None:
    """In the server's process before it starts: SIGINT and SIGTERM as a new Python expects them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
