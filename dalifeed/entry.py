"""The console scripts of the commands that import DALI (dali-train, dali-bench): DALI is checked first, so that
a base install without it (`pip install dalifeed` brings no DALI: which CUDA build is the user's choice,
docs/gpu.md#the-cuda-stack) gets one line naming the install for this node, not an ImportError traceback."""

from __future__ import annotations

import importlib
import sys

import click

from .stack import dali_import_error, dali_missing


def exit_without_dali(error: ImportError) -> None:
    """The one line (exit 2) every entry point gives where DALI does not import."""
    click.echo(f"Error: {dali_missing(error)}", err=True)
    sys.exit(2)


def _run(target: str) -> None:
    if (error := dali_import_error()) is not None:
        exit_without_dali(error)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)()


def dali_train() -> None:
    _run("dalifeed.train.cli:main")


def dali_bench() -> None:
    _run("dalifeed.bench.cli:main")
