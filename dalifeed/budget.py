"""How many DALI threads a pipeline gets by default: this process's share of the node's CPUs, capped.

Every rank of a node builds its own pipelines, and torchrun binds nothing: each of 8 ranks on a 64-CPU
node inherits all 64 CPUs, so "one thread per CPU" is 8 x 64 busy threads per node. The default divides
the CPUs this process may use (`runtime.usable_cores`) by the ranks on this node, and caps the result
where more threads stop helping:

- `gpu` (nvJPEG, `mixed` decoding): 6, what NVIDIA's published DGX-A100 and DGX-H100 ResNet-50
  configurations give each GPU (MLPerf Training `config_DGXA100.sh`, `config_DGXH100.sh`: DALI_THREADS=6;
  defaults.py lists the files). The GPU and its JPEG engine decode; the CPU threads parse the files, run
  the reader and Huffman-decode the share of JPEGs not sent to the hardware decoder. (DALI's own examples
  use 3-4, DeepLearningExamples 5.) Each mixed-decoder thread also holds its own nvJPEG buffers, so threads
  beyond the need cost GPU and pinned memory (docs/gpu.md).
- `cpu` and `hybrid` (libjpeg-turbo decoding on the CPU): 16. Here the CPU threads are the decoder, and 16
  decode several times what one GPU training ResNet-50 takes (docs/benchmarks.md); past that, threads only
  contend with the trainer for the CPUs.

`make_loader(num_threads=)` and `dali-train --dali-threads` override it; dali-bench does not use it (its
`--workers` gives every loader it races the same threads).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dalifeed.runtime import usable_cores

from .defaults import MIXED_DECODE_THREADS

MIXED_DECODE_MAX_THREADS = MIXED_DECODE_THREADS
CPU_DECODE_MAX_THREADS = 16


@dataclass(frozen=True)
class ThreadBudget:
    """DALI threads per pipeline for this process, and what they were worked out from."""

    threads: int
    cores: int  # CPUs this process may use
    ranks_on_node: int  # processes of this job on this node, sharing those CPUs
    cap: int
    device: str

    def describe(self) -> str:
        share = self.cores // self.ranks_on_node
        why = f"{self.cores} CPUs this process may use / {self.ranks_on_node} rank(s) on this node = " + \
            (str(share) if share >= 1 else "less than 1, so at least 1")
        if share > self.cap:
            decoder = "GPU (mixed) decoding" if self.device == "gpu" else "CPU decoding"
            why += f", capped at {self.cap} for {decoder}"
        return f"DALI threads per pipeline: {self.threads} ({why})"


def ranks_on_node(uses_gpu: bool, visible_gpus: int, environ: Mapping[str, str] = os.environ) -> int:
    """The processes of this job that share this node's CPUs: torchrun's LOCAL_WORLD_SIZE; under another
    launcher that sets only WORLD_SIZE, one rank per visible GPU (at most WORLD_SIZE); a single process: 1.
    (A single process on an 8-GPU node uses one GPU and every CPU, so the visible GPUs alone say nothing.)"""
    local = environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    world = environ.get("WORLD_SIZE", "")
    if uses_gpu and world.isdigit() and int(world) > 1:
        return max(1, min(int(world), visible_gpus))
    return 1


def thread_budget(device: str, *, cores: int | None = None, visible_gpus: int | None = None,
                  environ: Mapping[str, str] = os.environ) -> ThreadBudget:
    """The default DALI threads per pipeline for pipelines on `device` ('cpu', 'gpu' or 'hybrid') in this
    process: `cores` (default `usable_cores()`) divided by the ranks on this node, at least 1, at most the
    cap for the decoder the device uses (module docstring)."""
    uses_gpu = device in ("gpu", "hybrid")
    if cores is None:
        cores = usable_cores(environ=environ)
    if visible_gpus is None:
        visible_gpus = _visible_gpus() if uses_gpu else 0
    ranks = ranks_on_node(uses_gpu, visible_gpus, environ)
    cap = MIXED_DECODE_MAX_THREADS if device == "gpu" else CPU_DECODE_MAX_THREADS
    return ThreadBudget(threads=max(1, min(cap, cores // ranks)), cores=cores, ranks_on_node=ranks, cap=cap,
                        device=device)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()
