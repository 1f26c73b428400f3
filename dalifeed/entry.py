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


def dali_import_error() -> ImportError | None:
    """Why DALI does not import here, or None when it does."""
    try:
        import nvidia.dali  # noqa: F401  (the command imports it anyway)
    except ImportError as e:
        return e
    return None


def exit_without_dali(error: ImportError) -> None:
    """The one line (exit 2) every entry point gives where DALI does not import."""
    click.echo(f"Error: {dali_missing(error)}", err=True)
    sys.exit(2)


def is_dali_missing(error: ImportError) -> bool:
    """Whether an ImportError is DALI's (nvidia.dali, a module of it, or no `nvidia` package at all, as with a
    CPU-only torch) rather than another package's."""
    name = error.name or ""
    return name == "nvidia" or name.split(".")[:2] == ["nvidia", "dali"] or "nvidia.dali" in str(error)


def _run(target: str) -> None:
    if (error := dali_import_error()) is not None:
        exit_without_dali(error)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)()


def dali_train() -> None:
    _run("dalifeed.train.cli:main")


def dali_bench() -> None:
    _run("dalifeed.bench.cli:main")
