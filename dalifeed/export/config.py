"""`ExportConfig`: what `dalifeed export` does, checked up front; no DALI or torch needed to read it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dalifeed.usage import output_folder_problem

WEIGHTS = ("best", "last", "ema", "swa")


class ExportError(Exception):
    """A run folder or an option `dalifeed export` cannot use: one line for the user, exit 2."""


DEVICES = ("gpu", "cpu")
EXPORT_RECORD = "export.json"  # in REPO: the config and what was exported; also what marks a folder as an export


@dataclass
class ExportConfig:
    """What `dalifeed export` does; printed at start and saved as REPO/export.json.

    Attributes:
        run: The dali-train run folder.
        repo: The model repository to write (made, or replaced when it holds an earlier export).
        weights: best, last, ema or swa; None: what the run reports as its result (swa after SWA, else best, else last).
        device: Where Triton runs the models: gpu (nvJPEG decoding, KIND_GPU) or cpu (KIND_CPU).
        name: The ensemble's name; the DALI model is `{name}_preprocess`, the classifier `{name}_onnx`.
        max_batch_size: Triton's largest batch for each model (also the batch the DALI pipeline is built for).
        dali_threads: The DALI model's CPU threads.
        triton_release: The YY.MM of NVIDIA's Triton container the README's commands name.
    """

    run: str
    repo: str
    weights: str | None = None
    device: str = "gpu"
    name: str = "classifier"
    max_batch_size: int = 32
    dali_threads: int = 4
    triton_release: str = "26.10"

    def validate(self) -> None:
        """Each option checked, naming the bad value (ExportError)."""
        checks = [
            (self.weights is None or self.weights in WEIGHTS,
             f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}"),
            (self.device in DEVICES, f"--device must be gpu or cpu, got {self.device!r}"),
            (self.max_batch_size >= 1, f"--max-batch-size must be >= 1, got {self.max_batch_size}"),
            (self.dali_threads >= 1, f"--dali-threads must be >= 1, got {self.dali_threads}"),
            (bool(self.name) and all(c.isalnum() or c in "_-" for c in self.name),
             f"--name must be letters, digits, _ and -, got {self.name!r}"),
            (re.fullmatch(r"\d\d\.\d\d(\.\d+)?", self.triton_release) is not None,
             f"--triton-release must be a container release such as 26.10, got {self.triton_release!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ExportError(message)
        problem = output_folder_problem("REPO", self.repo)
        if problem:
            raise ExportError(problem)
        repo = Path(self.repo)
        if repo.is_dir() and any(repo.iterdir()) and not (repo / EXPORT_RECORD).is_file():
            raise ExportError(f"REPO {repo}: a folder that holds other files than an earlier export (no "
                              f"{EXPORT_RECORD}); choose an empty or new folder")
