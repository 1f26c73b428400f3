"""Timing a loader fairly: warm up, synchronise, time, repeat; CPU and memory of the whole process tree."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import psutil
import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forever(loader: Iterable) -> Iterator:
    """Batches across epoch boundaries, as a trainer sees them. An epoch without a batch is an error, not an
    endless loop."""
    while True:
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if count == 0:
            raise RuntimeError("the loader yielded no batch in a whole epoch (fewer images than one batch?)")


def process_tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me] + me.children(recursive=True)


class ResourceMonitor:
    """CPU seconds used by this process and its children (DataLoader workers) over a window, and the peak
    resident memory of the tree, sampled every 100 ms."""

    def __init__(self) -> None:
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _cpu_seconds(self) -> float:
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

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = 0
            for p in process_tree():
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self._stop.wait(0.1)

    def __enter__(self) -> "ResourceMonitor":
        self._cpu0, self._t0 = self._cpu_seconds(), time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_seconds = self._cpu_seconds() - self._cpu0
        self.wall_seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()


@dataclass
class Timing:
    images_per_s: list[float]
    cpu_percent: float  # of all cores, over the timed runs
    peak_rss_mb: float
    output: str  # shape, dtype and device of a batch: the loaders must agree

    @property
    def median(self) -> float:
        return statistics.median(self.images_per_s)


def time_loader(loader: Iterable, device: torch.device, *, warmup_batches: int, seconds: float | None,
                batches: int | None, repeats: int, cores: int) -> Timing:
    """`repeats` timed windows of `seconds` (or of `batches` batches) after `warmup_batches` untimed ones.
    Only the end of each window synchronises: a sync per batch would serialise the pipeline."""
    stream = forever(loader)
    for _ in range(warmup_batches):
        images, labels = next(stream)
    synchronize(device)
    rates = []
    with ResourceMonitor() as monitor:
        for _ in range(repeats):
            count, n_batches = 0, 0
            start = time.perf_counter()
            while True:
                images, labels = next(stream)
                count += len(labels)  # a tensor of labels, or a list of detection targets
                n_batches += 1
                if batches is not None and n_batches >= batches:
                    break
                if seconds is not None and time.perf_counter() - start >= seconds:
                    break
            synchronize(device)
            rates.append(count / (time.perf_counter() - start))
    output = describe_batch(images)
    cpu_percent = 100 * monitor.cpu_seconds / (monitor.wall_seconds * cores)
    return Timing(rates, cpu_percent, monitor.peak_rss / 2**20, output)


def describe_batch(images) -> str:
    """Shape, dtype and device of a batch (of a list of images: how many, and the first one's)."""
    if isinstance(images, (list, tuple)):
        return f"{len(images)} x {describe_batch(images[0])}"
    return f"{tuple(images.shape)} {str(images.dtype).removeprefix('torch.')} {images.device.type}"


def train_steps_per_s(model: torch.nn.Module, batches: Iterator, device: torch.device, steps: int,
                      warmup: int, amp: bool, progress=lambda done, total: None) -> tuple[float, float]:
    """Training steps/s of `model` fed by `batches`, and the share of step time spent waiting for them.
    `progress(done, total)` is called before the first step and after each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    waited = 0.0
    progress(0, warmup + steps)
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            start, waited = time.perf_counter(), 0.0
        t0 = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - t0
        # bf16 autocast on a GPU only: on a CPU without AVX-512 BF16 it is emulated and 20x slower than fp32
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp and device.type == "cuda"):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress(step + 1, warmup + steps)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return steps / elapsed, waited / elapsed


def synthetic_batches(batch: tuple[torch.Tensor, torch.Tensor]) -> Iterator:
    """The same on-device batch forever: the model's speed with a loader that costs nothing."""
    while True:
        yield batch
