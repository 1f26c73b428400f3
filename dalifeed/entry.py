"""The console scripts of the commands that import DALI (dali-train, dali-bench): DALI is checked first, so that
a base install without it (`pip install dalifeed` brings no DALI: which CUDA build is the user's choice,
docs/gpu.md#the-cuda-stack) gets one line naming the install for this node, not an ImportError traceback."""

from __future__ import annotations

import importlib
import sys

import click


def dali_missing(error: ImportError) -> str:
    """The line for a DALI that does not import: the install `stack.check` names for this node, or, where a DALI
    package is installed but fails to import, how to see why."""
    from .stack import check, probe

    stack = probe()
    if not stack.dali_packages:
        return check(stack).problems[0]
    return (f"NVIDIA DALI ({', '.join(stack.dali_packages)}) is installed but does not import ({error}): "
            f"python -c \"import nvidia.dali\" shows why")


def _run(target: str) -> None:
    try:
        import nvidia.dali  # noqa: F401  (the command imports it anyway)
    except ImportError as e:
        click.echo(f"Error: {dali_missing(e)}", err=True)
        sys.exit(2)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)()


def dali_train() -> None:
    _run("dalifeed.train.cli:main")


def dali_bench() -> None:
    _run("dalifeed.bench.cli:main")
