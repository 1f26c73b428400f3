"""What a timed window costs the machine: CPU seconds of this process tree, and probes read every 100 ms
on a thread (the tree's resident memory always; GPU and JPEG-engine utilisation where NVML answers).

dali-bench's loader timings (measure.time_loader) and gpu-check's hw-decoder and training steps use the
same sampler; only the probes differ.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import psutil

Probe = Callable[[], "float | None"]  # one reading, or None where there is none this time


def process_tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def tree_cpu_seconds() -> float:
    """User + system seconds of this process and its children so far."""
    # Workers that exited and were reaped inside the window (an epoch's non-persistent workers) are no
    # longer in the tree; their time lives on in this process's children_* counters.
    mine = psutil.Process().cpu_times()
    total = mine.children_user + mine.children_system
    for p in process_tree():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tree_rss_bytes() -> int:
    """Resident memory of this process and its children (DataLoader workers, a dali-train subprocess)."""
    rss = 0
    for p in process_tree():
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    return rss


def gpu_probes(index: int = 0) -> dict[str, Probe]:
    """GPU and JPEG-engine (NVJPG: the hardware JPEG decoder) utilisation in percent of torch's cuda:`index`,
    read from NVML (dalifeed.nvml); none on a machine without NVML."""
    from dalifeed.nvml import open_gpu

    gpu = open_gpu(index)
    if gpu is None:
        return {}
    nvml, handle = gpu

    def reading(read) -> Probe:
        def probe():
            try:
                return read()
            except Exception:  # a figure this driver does not give: no sample, never a failed run
                return None
        return probe

    return {"gpu_util_percent": reading(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "jpeg_engine_util_percent": reading(lambda: nvml.nvmlDeviceGetJpgUtilization(handle)[0])}


class ResourceSampler:
    """Over a `with` block: `cpu_seconds` and `wall_seconds` of the process tree, and every probe read every
    `period` seconds into `samples[name]` (`rss_bytes` always, then `probes`)."""

    def __init__(self, probes: dict[str, Probe] | None = None, period: float = 0.1):
        self.probes: dict[str, Probe] = {"rss_bytes": tree_rss_bytes, **(probes or {})}
        self.period = period
        self.samples: dict[str, list[float]] = {name: [] for name in self.probes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, probe in self.probes.items():
                value = probe()
                if value is not None:
                    self.samples[name].append(value)
            self._stop.wait(self.period)

    def __enter__(self) -> ResourceSampler:
        self._cpu0, self._t0 = tree_cpu_seconds(), time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_seconds = tree_cpu_seconds() - self._cpu0
        self.wall_seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()

    def peak(self, name: str) -> float:
        return max(self.samples.get(name) or [0])

    def mean(self, name: str) -> float | None:
        """The mean of probe `name`'s samples, or None where it gave none (no such probe here)."""
        values = self.samples.get(name)
        return statistics.fmean(values) if values else None
