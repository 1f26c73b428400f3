"""gpu-check's view of a node that its steps share without importing gpu_check: what a dali-train rank's
`mixed` decoder reserves at dali-train's default DALI threads, and what a step is given (`StepRun`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from dalifeed.budget import thread_budget
from dalifeed.decode import decoder_memory


def decoder_budget(cores: int | None = None, gpus: int | None = None, environ=os.environ) -> dict:
    """What each `mixed` decoder of a dali-train rank on this node reserves when built, at dali-train's default
    DALI threads per pipeline for one rank per visible GPU (`torchrun --nproc-per-node gpu`; budget.py), not
    at --workers: decode.decoder_memory (gpu-evidence.md), its paddings per thread and the GPU and pinned host
    memory they add up to. `cores` and `gpus` default to this process's (usable_cores, torch)."""

    gpus = torch.cuda.device_count() if gpus is None else gpus
    budget = thread_budget("gpu", cores=cores, visible_gpus=gpus,
                           environ={**environ, "LOCAL_WORLD_SIZE": str(max(1, gpus))})
    memory, mib = decoder_memory(budget.threads), 2**20
    return {"threads": budget.threads, "ranks_on_node": budget.ranks_on_node, "cores": budget.cores,
            "budget": budget.describe(),
            "device_padding_mib": memory.device_padding / mib, "host_padding_mib": memory.host_padding / mib,
            "gpu_mib": memory.device_bytes / mib, "pinned_mib": memory.pinned_bytes / mib}


class StepRun(Protocol):
    """What a gpu-check step is given (gpu_check.CheckRun), said here so that the step modules do not import
    gpu_check, which imports them."""

    cfg: Any  # gpu_check.GpuCheckConfig
    has_gpu: bool
    log: Callable[[str], None]

    @property
    def shards(self) -> Path: ...

    @property
    def coco_shards(self) -> Path: ...

    @property
    def device(self) -> str: ...

    def train_slice(self, name: str, synthetic: bool, extra: list[str] | tuple = ()) -> dict: ...
