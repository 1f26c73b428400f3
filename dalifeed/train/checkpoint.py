"""Checkpoints: everything a resumed run needs to continue exactly as an uninterrupted one would."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from dalifeed.atomic import atomic_path

from .config import ConfigError

LAST, BEST = "last.pt", "best.pt"


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, state: dict) -> None:
    """torch.save to a temp name, fsync, rename: a kill or power loss mid-write leaves the previous
    checkpoint intact."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)  # through a Python file, so a full disk surfaces as OSError (DiskFull)


def size_of(state) -> int:
    """Bytes of the tensors in a checkpoint payload: about what it takes on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(size_of(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(size_of(v) for v in state)
    return 0


def load(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: no checkpoint to resume from")
    try:
        # our own file: it holds RNG states and the config, not only tensors
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f"{path}: unreadable checkpoint ({type(e).__name__}: {first_line(e)})") from None


def first_line(error: BaseException) -> str:
    """torch.load's errors run over several lines (weights_only's advice); the error line says one."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def load_pretrained(model: torch.nn.Module, path: str) -> list[str]:
    """Load local weights (a state_dict, or a checkpoint holding 'model'); tensors whose shape differs —
    the classifier head when the class count changes — keep their fresh initialisation. Returns those."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"--pretrained {path}: unreadable ({type(e).__name__}: {first_line(e)})") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    own = model.state_dict()
    unknown = [k for k in state if k not in own]
    if unknown or not state:
        raise ConfigError(f"--pretrained {path}: does not fit this model ({len(unknown)} unknown keys, "
                          f"e.g. {unknown[:2]})")
    replaced = [k for k, v in state.items() if own[k].shape != v.shape]
    if len(replaced) > 2:  # more than a head's weight and bias: wrong architecture
        raise ConfigError(f"--pretrained {path}: {len(replaced)} tensors differ in shape, e.g. {replaced[:2]}")
    model.load_state_dict({k: v for k, v in state.items() if k not in replaced}, strict=False)
    return replaced
