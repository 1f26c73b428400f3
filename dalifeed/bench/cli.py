"""`dali-bench`: the DALI pipelines against a tuned torch DataLoader, same data, same augmentation."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import torch

from dalifeed.format import ManifestError, ShardManifest

from .loaders import LOADERS, build_loader
from .measure import forever, synthetic_batches, time_loader, train_steps_per_s


@dataclass
class BenchConfig:
    imagefolder: Path
    shards: Path
    out: Path
    loaders: list[str] = field(default_factory=lambda: list(LOADERS))
    split: str = "train"
    batch_size: int = 64
    image_size: int = 224
    seconds: float | None = 10.0
    epochs: int | None = None  # instead of seconds: time whole passes over the split
    repeats: int = 3
    warmup_batches: int = 5
    workers: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    model: str | None = None
    model_steps: int = 20
    amp: bool = True

    def validate(self) -> None:
        if not self.imagefolder.is_dir():
            raise click.UsageError(f"--imagefolder {self.imagefolder}: no such folder")
        try:
            manifest = ShardManifest.load(self.shards)
        except ManifestError as e:
            raise click.UsageError(f"--shards: {e}") from None
        if self.split not in manifest.splits:
            raise click.UsageError(f"--shards {self.shards}: no split {self.split!r}")
        unknown = [name for name in self.loaders if name not in LOADERS]
        if unknown:
            raise click.UsageError(f"--loaders: unknown {', '.join(unknown)} (choose from {', '.join(LOADERS)})")
        for name, value in (("--batch-size", self.batch_size), ("--repeats", self.repeats),
                            ("--workers", self.workers), ("--image-size", self.image_size)):
            if value < 1:
                raise click.UsageError(f"{name} must be >= 1, got {value}")

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def environment() -> dict:
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
        "cores": len(os.sched_getaffinity(0)), "cpu": cpu, "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Time every loader (and, with a model, training fed by it); returns the JSON-ready report."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images = ShardManifest.load(cfg.shards).num_samples(cfg.split)
    batches = max(1, cfg.epochs * images // cfg.batch_size) if cfg.epochs else None
    records, model_records = [], {}
    for name in cfg.loaders:
        if name == "dali-gpu" and device.type != "cuda":
            log(f"{name}: skipped (no GPU)")
            continue
        log(f"{name}: warming up, then {cfg.repeats} x {f'{cfg.epochs} epoch(s)' if batches else f'{cfg.seconds} s'} ...")
        loader = on_device(build_loader(name, imagefolder=cfg.imagefolder, shards=cfg.shards, split=cfg.split,
                                        batch_size=cfg.batch_size, image_size=cfg.image_size, workers=cfg.workers,
                                        device=device), device)
        timing = time_loader(loader, device, warmup_batches=cfg.warmup_batches, seconds=None if batches else cfg.seconds,
                             batches=batches, repeats=cfg.repeats, cores=len(os.sched_getaffinity(0)))
        record = {"loader": name, "images_per_s": timing.median, "images_per_s_runs": timing.images_per_s,
                  "cpu_percent": timing.cpu_percent, "peak_rss_mb": timing.peak_rss_mb, "output": timing.output}
        if cfg.model:
            record.update(measure_model(cfg, loader, device, model_records))
        records.append(record)
        log(f"{name}: {timing.median:.0f} images/s (runs: {', '.join(f'{r:.0f}' for r in timing.images_per_s)})")
        del loader
    base = next((r["images_per_s"] for r in records if r["loader"] == "baseline"), None)
    for r in records:
        r["speedup_vs_baseline"] = r["images_per_s"] / base if base else None
    return {"config": cfg.to_json(), "environment": environment(), "results": records,
            "synthetic": model_records.get("synthetic")}


class on_device:
    """Batches moved to the model's device (a no-op where they already are)."""

    def __init__(self, loader, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        for images, labels in self.loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def measure_model(cfg: BenchConfig, loader, device: torch.device, cache: dict) -> dict:
    """Train steps/s fed by `loader`, against the same model fed one synthetic on-device batch."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.get_model(cfg.model, num_classes=1000).to(device).train()
    stream = forever(loader)
    if "synthetic" not in cache:
        batch = next(stream)
        rate, _ = train_steps_per_s(model, synthetic_batches(batch), device, cfg.model_steps, 3, cfg.amp)
        cache["synthetic"] = {"model": cfg.model, "steps_per_s": rate, "images_per_s": rate * cfg.batch_size}
    rate, waited = train_steps_per_s(model, stream, device, cfg.model_steps, 3, cfg.amp)
    synthetic = cache["synthetic"]["steps_per_s"]
    return {"train_steps_per_s": rate, "train_vs_synthetic": rate / synthetic, "data_wait_share": waited}


def render_table(report: dict) -> str:
    has_model = any("train_steps_per_s" in r for r in report["results"])
    head = ["loader", "images/s (median)", "runs min-max", "x baseline", "CPU %", "peak RSS MB"]
    if has_model:
        head += ["train steps/s", "vs synthetic", "data wait"]
    rows = []
    for r in report["results"]:
        runs = r["images_per_s_runs"]
        row = [r["loader"], f"{r['images_per_s']:.0f}", f"{min(runs):.0f}-{max(runs):.0f}",
               f"{r['speedup_vs_baseline']:.2f}" if r["speedup_vs_baseline"] else "-",
               f"{r['cpu_percent']:.0f}", f"{r['peak_rss_mb']:.0f}"]
        if has_model:
            row += [f"{r['train_steps_per_s']:.2f}", f"{r['train_vs_synthetic']:.0%}", f"{r['data_wait_share']:.0%}"]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if report.get("synthetic"):
        s = report["synthetic"]
        lines.append(f"\nSynthetic on-device data: {s['model']} at {s['steps_per_s']:.2f} steps/s "
                     f"({s['images_per_s']:.0f} images/s).")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [r["loader"] for r in results]
    medians = [r["images_per_s"] for r in results]
    low = [m - min(r["images_per_s_runs"]) for m, r in zip(medians, results)]
    high = [max(r["images_per_s_runs"]) - m for m, r in zip(medians, results)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, medians, yerr=[low, high], capsize=4, color=["#888888", "#4c72b0", "#76b900", "#3d6b00"][:len(names)])
    for bar, r, above in zip(bars, results, high):
        if r["speedup_vs_baseline"]:
            ax.annotate(f"{r['speedup_vs_baseline']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height() + above),
                        ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    env = report["environment"]
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_title(f"{env['gpu'] or 'CPU only'}, {env['cores']} cores, batch {report['config']['batch_size']}, "
                 f"{report['config']['image_size']}px", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--imagefolder", type=click.Path(path_type=Path), required=True,
              help="The ImageFolder tree the baseline reads (the split's own folder, e.g. SRC/train).")
@click.option("--shards", type=click.Path(path_type=Path), required=True,
              help="The shard folder shard-convert made from the same images.")
@click.option("--loaders", default=",".join(LOADERS), show_default=True,
              help="Comma-separated subset to run. dali-gpu is skipped without a GPU.")
@click.option("--split", default="train", show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option("--seconds", type=float, default=10.0, show_default=True, help="Length of each timed run.")
@click.option("--epochs", type=int, default=None, help="Time whole passes over the split instead of --seconds.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per loader (median reported).")
@click.option("--warmup", "warmup_batches", type=int, default=5, show_default=True, help="Untimed batches first.")
@click.option("--workers", type=int, default=len(os.sched_getaffinity(0)), show_default=True,
              help="DataLoader workers and DALI threads alike: the same cores for everyone.")
@click.option("--model", default=None, help="Also time training steps of this torchvision model per loader, "
                                             "against synthetic on-device data (e.g. resnet50).")
@click.option("--model-steps", type=int, default=20, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("build/bench"), show_default=True,
              help="Folder for bench.json, bench.png and config.json.")
def main(**options):
    """Race the DALI pipelines against the torch DataLoader baseline on the same images and augmentation
    (RandomResizedCrop + flip + normalise to float batches on the model's device).

    \b
    Loaders:
      baseline    torchvision ImageFolder + DataLoader (workers = cores, uint8 collate, pinned memory,
                  normalise on the device, persistent workers, prefetch) -- the fair baseline
      webdataset  plain webdataset over the shards + DataLoader, same transform
      dali-cpu    dalifeed's DALI pipeline on the CPU
      dali-gpu    dalifeed's DALI pipeline decoding with nvJPEG on the GPU (GPU machines only)

    \b
    Example:
      dali-bench --imagefolder /data/imagenet/train --shards /data/imagenet-shards --model resnet50

    Reports images/s (median of --repeats), speed-up over baseline measured in the same run, CPU use and
    peak memory; writes OUT/bench.json, OUT/bench.png and OUT/config.json.
    """
    options["loaders"] = [name.strip() for name in options["loaders"].split(",") if name.strip()]
    if options["epochs"] is not None:
        options["seconds"] = None
    cfg = BenchConfig(**options)
    cfg.validate()
    click.echo(f"dali-bench: {json.dumps(cfg.to_json())}", err=True)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    report = run_bench(cfg, log=lambda msg: click.echo(msg, err=True))
    (cfg.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, cfg.out / "bench.png")
    click.echo(render_table(report))
    click.echo(f"\nwrote {cfg.out / 'bench.json'} and {cfg.out / 'bench.png'}", err=True)


if __name__ == "__main__":
    sys.exit(main())
