"""dali-bench's race: time every loader on the same data (and, with a model, training fed by each), and
return the JSON-ready report that `report.py` renders and the CLI writes."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dalifeed.pipelines.dataset import ShardData
from dalifeed.runtime import usable_cores
from dalifeed.stack import choose_device, stack_report

from .config import BenchConfig
from .detection import build_detection_loader
from .loaders import batches_ahead, race_loader, skip_reason
from .measure import forever, synthetic_batches, time_loader, train_steps_per_s
from .names import PEERS
from .peers import peer_loader


def environment() -> dict:
    """Versions, cores, CPU and GPU of the host: every report carries them."""
    import nvidia.dali
    import torchvision
    import webdataset

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
        "dali": nvidia.dali.__version__, "webdataset": getattr(webdataset, "__version__", "?"),
        "cores": usable_cores(), "cpu": cpu, "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_bench(cfg: BenchConfig, dataset: ShardData, log=print) -> dict:
    """Time every loader (and, with a model, training fed by it) on `dataset` (`cfg.validate()` opened it);
    returns the JSON-ready report."""
    device = torch.device("cuda" if choose_device("auto", stack_report()) == "gpu" else "cpu")  # as the loaders decide
    images = dataset.num_samples(cfg.split)
    batches = max(1, cfg.epochs * images // cfg.batch_size) if cfg.epochs else None
    records, model_records = [], {}
    for name in cfg.loaders:
        skipped = skip_reason(name, cfg.shards, device.type)
        if skipped:
            log(f"{name}: {skipped}")
            continue
        window = f"{cfg.epochs} epoch(s)" if batches else f"{cfg.seconds:g} s"
        eta = f" (about {cfg.repeats * cfg.seconds + 5:.0f} s)" if not batches else ""
        log(f"{name}: warming up, then {cfg.repeats} x {window}{eta} ...")
        loader = bench_loader(cfg, dataset, name, device)
        timing = time_loader(loader, device, warmup_batches=cfg.warmup_batches,
                             seconds=None if batches else cfg.seconds, batches=batches, repeats=cfg.repeats,
                             cores=usable_cores(), ahead=batches_ahead(loader))
        record = {"loader": name, "images_per_s": timing.median, "images_per_s_runs": timing.images_per_s,
                  "cpu_percent": timing.cpu_percent, "peak_rss_mb": timing.peak_rss_mb, "output": timing.output,
                  "epoch_start_batch_times": timing.epoch_start_batch_times,
                  "epoch_starts_timed": timing.epoch_starts_timed}
        log(f"{name}: {timing.median:.0f} images/s (runs: {', '.join(f'{r:.0f}' for r in timing.images_per_s)})"
            + epoch_start_note(timing))
        if cfg.model:
            record.update(measure_model(cfg, loader, device, model_records, log, name))
        records.append(record)
        del loader
    base = next((r["images_per_s"] for r in records if r["loader"] == "baseline"), None)
    for r in records:
        r["speedup_vs_baseline"] = r["images_per_s"] / base if base else None
    return {"config": cfg.to_json(), "environment": environment(), "dataset": dataset_of(cfg, dataset),
            "results": records, "synthetic": model_records.get("synthetic")}


def epoch_start_note(timing) -> str:
    if timing.epoch_start_batch_times is None:
        return "; no epoch began in the timed windows"
    return (f"; first batch of an epoch: {timing.epoch_start_batch_times:.1f} batch times "
            f"(median of {timing.epoch_starts_timed} epochs)")


def bench_loader(cfg: BenchConfig, dataset: ShardData, name: str, device: torch.device):
    """Loader `name` of cfg.task over `dataset`, handing out batches on `device`."""
    if cfg.task == "detection":
        return build_detection_loader(name, images=cfg.images, annotations=cfg.annotations, shards=dataset,
                                      split=cfg.split, batch_size=cfg.batch_size, image_size=cfg.image_size,
                                      workers=cfg.workers, device=device, hw_decoder_load=cfg.hw_decoder_load)
    if name in PEERS:  # converted once into its own format under OUT/peers
        return on_device(peer_loader(name, shards=dataset.manifest, split=cfg.split, batch_size=cfg.batch_size,
                                     image_size=cfg.image_size, workers=cfg.workers, device=device, workdir=cfg.out,
                                     fp16=cfg.fp16, augment=cfg.augment()), device)
    return on_device(race_loader(name, imagefolder=cfg.imagefolder, shards=dataset, split=cfg.split,
                                 batch_size=cfg.batch_size, image_size=cfg.image_size, workers=cfg.workers,
                                 device=device, fp16=cfg.fp16, hw_decoder_load=cfg.hw_decoder_load,
                                 augment=cfg.augment()), device)


def dataset_of(cfg: BenchConfig, dataset: ShardData) -> dict:
    manifest = dataset.manifest
    images = dataset.num_samples(cfg.split)
    name = f"COCO {cfg.split}" if manifest.kind == "coco" else Path(manifest.source).name or str(manifest.source)
    return {"name": name, "task": cfg.task, "split": cfg.split, "images": images,
            "classes": manifest.num_classes}


class on_device:
    """Batches moved to the model's device (a no-op where they already are)."""

    def __init__(self, loader, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        for images, labels in self.loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def measure_model(cfg: BenchConfig, loader, device: torch.device, cache: dict, log, name: str) -> dict:
    """Train steps/s fed by `loader`, against the same model fed one synthetic on-device batch. Long on a
    CPU: says how long after the first step, and shows a progress bar where someone watches."""
    from dalifeed.train.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model, 1000, image_size=cfg.image_size).to(device).train()  # as dali-train builds it
    stream = forever(loader)
    warmup = 3
    if "synthetic" not in cache:
        batch = next(stream)
        rate, _ = train_steps_per_s(model, synthetic_batches(batch), device, cfg.model_steps, warmup, cfg.amp,
                                    progress=StepProgress(f"{cfg.model} on synthetic data", log))
        cache["synthetic"] = {"model": cfg.model, "steps_per_s": rate, "images_per_s": rate * cfg.batch_size}
    rate, waited = train_steps_per_s(model, stream, device, cfg.model_steps, warmup, cfg.amp,
                                     progress=StepProgress(f"{cfg.model} fed by {name}", log))
    synthetic = cache["synthetic"]["steps_per_s"]
    log(f"{name}: {cfg.model} at {rate:.2f} steps/s, {rate / synthetic:.0%} of synthetic, data wait {waited:.0%}")
    return {"train_steps_per_s": rate, "train_vs_synthetic": rate / synthetic, "data_wait_share": waited}


class StepProgress:
    """Progress of timed training steps: after the first, one line with the estimated time left (for logs),
    and a tqdm bar with its own ETA when stderr is a terminal."""

    def __init__(self, what: str, log):
        self.what, self.log, self.bar, self.started = what, log, None, None

    def __call__(self, done: int, total: int) -> None:
        if done == 0:
            self.started = time.perf_counter()
            self.bar = tqdm(total=total, desc=self.what, unit="step", leave=False, disable=not sys.stderr.isatty())
            return
        self.bar.update(1)
        if done == 1:
            per_step = time.perf_counter() - self.started
            self.log(f"{self.what}: {total} steps, about {per_step * (total - 1):.0f} s more "
                     f"at {per_step:.1f} s a step")
        if done == total:
            self.bar.close()
