"""Timing a loader fairly: warm up, synchronise, time, repeat; CPU and memory of the whole process tree
(sampler.ResourceSampler)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .sampler import ResourceSampler


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def with_epoch_starts(loader: Iterable) -> Iterator[tuple[Any, bool]]:
    """(batch, whether it is the first of an epoch) across epoch boundaries, as a trainer sees them. An epoch
    without a batch is an error, not an endless loop."""
    while True:
        count = 0
        for batch in loader:
            yield batch, count == 0
            count += 1
        if count == 0:
            raise RuntimeError("the loader yielded no batch in a whole epoch (fewer images than one batch?)")


def forever(loader: Iterable) -> Iterator:
    """Batches across epoch boundaries, as a trainer sees them."""
    return (batch for batch, _ in with_epoch_starts(loader))


@dataclass
class Timing:
    images_per_s: list[float]
    cpu_percent: float  # of all cores, over the timed runs
    peak_rss_mb: float
    output: str  # shape, dtype and device of a batch: the loaders must agree
    # the wait for an epoch's first batch over the median wait for a batch (median over the epochs that began
    # in the timed windows; None when none did): the pause between epochs, in batch times
    epoch_start_batch_times: float | None = None
    epoch_starts_timed: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.images_per_s)


def time_loader(loader: Iterable, device: torch.device, *, warmup_batches: int, seconds: float | None,
                batches: int | None, repeats: int, cores: int, ahead: int = 0) -> Timing:
    """`repeats` timed windows of `seconds` (or of `batches` batches) after `warmup_batches` untimed ones and
    `ahead` more: the batches the loader can hold ready (`loaders.batches_ahead`), drained so that no window
    counts batches made before it began. Only the end of each window synchronises: a sync per batch would
    serialise the pipeline. Each batch's wait is timed too, for the pause before an epoch's first batch."""
    stream = with_epoch_starts(loader)
    for _ in range(warmup_batches + ahead):
        (images, labels), _ = next(stream)
    synchronize(device)
    rates, starts, others = [], [], []
    with ResourceSampler() as sampler:
        for _ in range(repeats):
            count, n_batches = 0, 0
            start = last = time.perf_counter()
            while True:
                (images, labels), first = next(stream)
                now = time.perf_counter()
                (starts if first else others).append(now - last)  # as the training loop waits for it
                last = now
                count += len(labels)  # a tensor of labels, or a list of detection targets
                n_batches += 1
                if batches is not None and n_batches >= batches:
                    break
                if seconds is not None and now - start >= seconds:
                    break
            synchronize(device)
            rates.append(count / (time.perf_counter() - start))
    output = describe_batch(images)
    cpu_percent = 100 * sampler.cpu_seconds / (sampler.wall_seconds * cores)
    epoch_start = statistics.median(starts) / statistics.median(others) if starts and others else None
    return Timing(rates, cpu_percent, sampler.peak("rss_bytes") / 2**20, output, epoch_start, len(starts))


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
        # bf16 autocast on a GPU only: on a CPU without AVX-512 BF16 it is emulated
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
