"""NVML (nvidia-ml-py) for the GPU this process computes on, found by its UUID, not by its index.

torch numbers the GPUs CUDA_VISIBLE_DEVICES leaves visible, NVML every GPU of the machine: with
CUDA_VISIBLE_DEVICES=2,3 (what Slurm and Kubernetes set), torch's cuda:0 is NVML's GPU 2, and NVML's GPU 0
belongs to another job. Both report a GPU's UUID: torch as `get_device_properties(i).uuid` (a `_CUuuid` whose
str is the bare "8-4-4-4-12" hex form, torch/csrc/cuda/Module.cpp), NVML as `nvmlDeviceGetUUID` with a
"GPU-" prefix. `nvml_index` matches them; `open_gpu` and `gpu_stats` are what dali-train and gpu-check use.

Memory: torch's allocator sees only torch's tensors; DALI's pools, nvJPEG's buffers and the CUDA context are
outside it. NVML's per-process figure holds them all; where NVML cannot attribute memory to this process
(inside a container its process list shows the host's pids), the GPU's whole used memory is what is left.
"""

from __future__ import annotations

import os


def nvml_index(cuda_uuid: str, nvml_uuids: list[str]) -> int | None:
    """The position in NVML's device list of the GPU whose UUID CUDA reports (with or without NVML's "GPU-"
    prefix; any case), or None when NVML lists no such GPU (a MIG instance has its own "MIG-" UUID)."""
    wanted = _bare(cuda_uuid)
    matches = [i for i, uuid in enumerate(nvml_uuids) if _bare(uuid) == wanted]
    return matches[0] if len(matches) == 1 else None


def _bare(uuid: str | bytes) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def process_memory(processes, pid: int) -> int | None:
    """Bytes of GPU memory NVML attributes to `pid` among `processes` (nvmlDeviceGetComputeRunningProcesses's
    records: `.pid`, `.usedGpuMemory`), or None when it lists no such process or no figure for it."""
    used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
    return sum(used) if used else None


def open_gpu(device_index: int):
    """(pynvml, NVML handle) of torch's `cuda:device_index`, or None where NVML is missing or does not list it."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
        index = nvml_index(str(torch.cuda.get_device_properties(device_index).uuid), uuids)
        return None if index is None else (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
    except Exception:  # no driver, no NVML, an NVML call this driver lacks: no figures, never a failed run
        return None


def gpu_stats(device) -> dict:
    """Utilisation and memory of this process's GPU (a torch.device), empty on the CPU: `gpu_util_percent`,
    `gpu_process_memory_gb` (NVML: this process, DALI's pools and the CUDA context included),
    `gpu_memory_used_gb` (NVML: the whole GPU, every process) and `gpu_max_memory_gb` (torch's allocator peak,
    tensors only)."""
    if device.type != "cuda":
        return {}
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    stats = {"gpu_max_memory_gb": torch.cuda.max_memory_allocated(index) / 2**30}
    gpu = open_gpu(index)
    if gpu is None:
        return stats
    pynvml, handle = gpu
    for name, read in (("gpu_util_percent", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                       ("gpu_memory_used_gb", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30),
                       ("gpu_process_memory_gb", lambda: process_memory(
                           pynvml.nvmlDeviceGetComputeRunningProcesses(handle), os.getpid()) / 2**30)):
        try:
            stats[name] = read()
        except Exception:  # a figure this driver or container does not give (TypeError: no such process)
            pass
    return stats
