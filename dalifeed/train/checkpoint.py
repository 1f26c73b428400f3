"""Checkpoints: everything a resumed run needs to continue exactly as an uninterrupted one would."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

from dalifeed.atomic import atomic_path
from dalifeed.usage import first_line

from .config import ConfigError

LAST, BEST = "last.pt", "best.pt"
TIMED = ("images_per_s", "epoch_seconds", "data_wait_share")  # and gpu_*: measured, so never equal twice


def rng_state() -> dict:
    """The random generators' states of this process. "cuda" is the generator of the GPU this process
    computes on (None without one), not every visible GPU's: a checkpoint from 8 GPUs must resume on 4, or
    under CUDA_VISIBLE_DEVICES=0, where a list of 8 states has nowhere to go."""
    return {
        "python": random.getstate(),
        "numpy": numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def numpy_state() -> dict:
    """NumPy's legacy generator state as a tensor and plain numbers: what `torch.load(weights_only=True)`
    reads (`--pretrained` loads our own checkpoints that way). `np.random.get_state()` is a tuple holding an
    ndarray, which the safe loader refuses."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_state(saved) -> None:
    """Restore `numpy_state()`, or the `np.random.get_state()` tuple checkpoints held before."""
    if isinstance(saved, dict):
        saved = (saved["name"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                 saved["cached_gaussian"])
    np.random.set_state(saved)


def restore_rng(state: dict) -> None:
    """Put the generators back as `rng_state()` found them. Only rank 0 saves, and every rank restores rank 0's
    states, its GPU's on each rank's own GPU: that is what each rank held anyway, since every rank seeds alike
    (`torch.manual_seed(cfg.seed)`) and DDP runs the same operations on every rank, so their generators stay
    equal (DALI's augmentations have their own seeds per rank and epoch)."""
    random.setstate(state["python"])
    set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = own_gpu_state(state["cuda"])
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)  # the current device: this rank's (distributed.setup set it)


def own_gpu_state(saved) -> torch.Tensor | None:
    """The CUDA generator state to restore on this process's GPU from a checkpoint's "cuda": one state, or
    (checkpoints written before) the list `get_rng_state_all()` made of every GPU rank 0 saw, whose first
    entry is the GPU rank 0 computed on (cuda:0, its LOCAL_RANK); None without one."""
    if isinstance(saved, (list, tuple)):
        return saved[0] if saved else None
    return saved


def save(path: Path, state: dict) -> None:
    """torch.save of `canonical(state)` to a temp name, fsync, rename: a kill or power loss mid-write leaves
    the previous checkpoint intact, and a resumed run writes the bytes an uninterrupted one would."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(canonical(state), f)  # through a Python file, so a full disk surfaces as OSError (DiskFull)


def untimed(metrics: dict | None) -> dict | None:
    """An epoch's metrics without what was timed or read from the GPU (metrics.jsonl keeps those): what a
    checkpoint holds, so that a resumed run's files are the uninterrupted run's, byte for byte."""
    if metrics is None:
        return None
    return {k: v for k, v in metrics.items() if k not in TIMED and not k.startswith("gpu_")}


def canonical(value):
    """`value` with its plain dicts, lists and tuples rebuilt and every string in them interned. Pickle
    writes a string it has seen before, as the same object, as a reference: without this, a config value read
    back from JSON on --resume ("cpu") is written in full where the uninterrupted run's, the very object torch
    names storage locations with, was a reference, and the files differ (torch.save's serialization_id, a
    hash of the records, with them). Other objects (tensors, a module's state_dict) are kept as they are."""
    kind = type(value)
    if kind is str:
        return sys.intern(value)
    if kind is dict:
        return {canonical(k): canonical(v) for k, v in value.items()}
    if kind in (list, tuple):
        return kind(canonical(v) for v in value)
    return value


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


def numpy_rng_globals() -> list:
    """What a dali-train checkpoint written before `numpy_state()` holds besides plain types and tensors:
    np.random.get_state()'s ndarray, its dtype and the function that rebuilds it. Allowed by name so that
    --pretrained reads those checkpoints with the safe loader too (an ndarray rebuilt from these runs no code)."""
    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:  # NumPy 1
        from numpy.core.multiarray import _reconstruct
    dtype_classes = [type(np.dtype(np.uint32))]  # NumPy 2 builds a dtype through its class (UInt32DType)
    return [np.ndarray, np.dtype, _reconstruct, *dtype_classes]


def load_weights(path: str):
    """torch.load with weights_only=True (no code from the file runs), numpy's RNG state allowed."""
    with torch.serialization.safe_globals(numpy_rng_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def load_pretrained(model: torch.nn.Module, path: str) -> list[str]:
    """Load local weights (a state_dict, or a checkpoint holding 'model': dali-train's last.pt and best.pt
    among them); tensors whose shape differs — the classifier head when the class count changes — keep
    their fresh initialisation. Returns those."""
    try:
        state = load_weights(path)
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
