"""NVML (nvidia-ml-py) for the GPU this process computes on, found by its UUID, not by its index.

torch numbers the GPUs CUDA_VISIBLE_DEVICES leaves visible, NVML every GPU of the machine: with
CUDA_VISIBLE_DEVICES=2,3 (what Slurm and Kubernetes set), torch's cuda:0 is NVML's GPU 2, and NVML's GPU 0
belongs to another job. Both report a GPU's UUID: torch as `get_device_properties(i).uuid` (a `_CUuuid` whose
str is the bare "8-4-4-4-12" hex form, torch/csrc/cuda/Module.cpp), NVML as `nvmlDeviceGetUUID` with a
"GPU-" prefix. `find_gpu` matches them; `open_gpu` and `gpu_stats` are what dali-train and gpu-check use.

NVML also lists GPUs this process may not open (another job's, under Slurm's ConstrainDevices: NO_PERMISSION on
their handle): `find_gpu` skips them. A MIG instance has its own UUID, which CUDA reports and NVML gives on the
instance's handle (nvmlDeviceGetMigDeviceHandleByIndex), not on its parent GPU's.

Memory: torch's allocator sees only torch's tensors; DALI's pools, nvJPEG's buffers and the CUDA context are
outside it. NVML's per-process figure holds them all; where NVML cannot attribute memory to this process
(inside a container its process list shows the host's pids), the GPU's whole used memory is what is left.
"""

from __future__ import annotations

import os


def _bare(uuid: str | bytes) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


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
        props = torch.cuda.get_device_properties(device_index)
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        handle = find_gpu(pynvml, str(props.uuid), pci)
        return None if handle is None else (pynvml, handle)
    except Exception:  # no driver, no NVML, an NVML call this driver lacks: no figures, never a failed run
        return None


def find_gpu(nvml, cuda_uuid: str, pci: tuple[int, int, int] | None = None):
    """The NVML handle of the GPU or MIG instance whose UUID CUDA reports, among those `nvml` (the pynvml module)
    lets this process open; else the one GPU not in MIG mode at CUDA's PCI (domain, bus, device); else None. GPUs
    whose handle or UUID NVML refuses are another job's: skipped."""
    wanted, at_pci = _bare(cuda_uuid), []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _bare(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError:
            continue
        if uuid == wanted:
            return handle
        instances = _mig_instances(nvml, handle)
        for instance in instances or ():
            try:
                if _bare(nvml.nvmlDeviceGetUUID(instance)) == wanted:
                    return instance
            except nvml.NVMLError:
                continue
        # a GPU in MIG mode is no CUDA device; its instances share its bus id, and its figures are all tenants'
        if instances is None and pci is not None and _pci(nvml, handle) == tuple(pci):
            at_pci.append(handle)
    return at_pci[0] if len(at_pci) == 1 else None


def _mig_instances(nvml, handle) -> list | None:
    """The MIG instances of a GPU in MIG mode this process may open; None for a GPU not in MIG mode."""
    try:
        if nvml.nvmlDeviceGetMigMode(handle)[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return None
    except nvml.NVMLError:  # NOT_SUPPORTED: a GPU without MIG
        return None
    try:
        slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except nvml.NVMLError:  # in MIG mode all the same: no instance this process may read
        return []
    instances = []
    for slot in range(slots):
        try:
            instances.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except nvml.NVMLError:  # NOT_FOUND: an empty slot
            continue
    return instances


def _pci(nvml, handle) -> tuple[int, int, int] | None:
    try:
        info = nvml.nvmlDeviceGetPciInfo(handle)
    except nvml.NVMLError:
        return None
    return info.domain, info.bus, info.device


def nvml_stats(nvml, handle, pid: int) -> dict:
    """NVML's figures of one GPU (or MIG instance) `handle`: `gpu_util_percent`, `gpu_memory_used_gb` and
    `gpu_process_memory_gb` (`pid`'s), each left out alone where NVML does not give it (a MIG instance answers
    NO_PERMISSION for its memory inside a container, NOT_SUPPORTED for its utilisation)."""
    readings = {"gpu_util_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                "gpu_memory_used_gb": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30,
                "gpu_process_memory_gb": lambda: process_memory(
                    nvml.nvmlDeviceGetComputeRunningProcesses(handle), pid) / 2**30}
    stats = {}
    for name, read in readings.items():
        try:
            stats[name] = read()
        except Exception:  # a figure this driver or container does not give (TypeError: no such process)
            pass
    return stats


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
    if gpu is not None:
        stats.update(nvml_stats(*gpu, os.getpid()))
    return stats
