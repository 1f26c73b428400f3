"""`dali-bench`: the DALI pipelines against a tuned torch DataLoader, same data, same augmentation."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import torch
from tqdm import tqdm

from dalifeed.format import ManifestError
from dalifeed.s3 import StorageError, is_s3_url
from dalifeed.shardfolder import open_shard_folder

from dalifeed.atomic import write_json_atomic
from dalifeed.cliutil import LOCATION, default, folder_not_created, output_folder_problem, run_command
from dalifeed.pipelines.checks import ShardDataError
from dalifeed.pipelines.augment import POLICIES
from dalifeed.pipelines.graphs import DEFAULT_HW_DECODER_LOAD, AugmentConfig
from dalifeed.runtime import usable_cores

from .detection import DETECTION_LOADERS, build_detection_loader, same_coco_data_problem
from .loaders import GPU_LOADERS, LOADERS, build_loader
from .measure import forever, synthetic_batches, time_loader, train_steps_per_s
from .same_data import same_data_problem


class BenchUsageError(Exception):
    """A bench that would measure nothing or something false: one line, exit 2."""


@dataclass
class BenchConfig:
    imagefolder: Path | None
    shards: Path | str  # a folder, or s3://bucket/prefix
    task: str = "classify"  # classify | detection
    images: Path | None = None  # detection: the COCO source the shards were made from
    annotations: Path | None = None
    out: Path = Path("build/bench")
    loaders: list[str] = field(default_factory=lambda: list(LOADERS))
    split: str = "train"
    batch_size: int = 64
    image_size: int = 224
    seconds: float | None = 10.0
    epochs: int | None = None  # instead of seconds: time whole passes over the split
    repeats: int = 3
    warmup_batches: int = 5
    workers: int = field(default_factory=usable_cores)
    model: str | None = None
    model_steps: int = 20
    amp: bool = True  # bf16 autocast for --model, on a GPU (on the CPU it would be emulated)
    fp16: bool = False  # every loader hands out float16 batches (what an AMP model consumes)
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD  # dali-gpu (both tasks): share of JPEGs for the hardware decoder
    allow_different_data: bool = False
    auto_augment: str | None = None  # a policy for every loader (torchvision's transforms.v2 in the torch ones)
    random_erase: float = 0.0  # RandomErasing's probability, every loader
    preview: int = 0  # also write OUT/preview.png: this many samples, DALI's output beside torchvision's

    def augment(self) -> AugmentConfig | None:
        """The policy and erasing every loader applies (None: the plain RandomResizedCrop + flip)."""
        if not self.auto_augment and not self.random_erase:
            return None
        return AugmentConfig(image_size=self.image_size, auto_augment=self.auto_augment,
                             random_erase=self.random_erase)

    def validate(self) -> None:
        if self.task not in ("classify", "detection"):
            raise BenchUsageError(f"--task must be classify or detection, got {self.task!r}")
        if self.task == "detection":
            self.validate_detection_source()
        elif self.imagefolder is None or not self.imagefolder.is_dir():
            raise BenchUsageError(f"--imagefolder {self.imagefolder}: no such folder" if self.imagefolder else
                                  "--imagefolder is required (the ImageFolder tree the shards were made from)")
        try:
            manifest = open_shard_folder(self.shards)
        except ManifestError as e:
            raise BenchUsageError(f"--shards: {e}") from None
        if self.task == "classify" and manifest.kind == "coco":  # their samples hold label lists, not one class
            raise BenchUsageError(f"--shards {self.shards} holds COCO shards: use --task detection (--task classify "
                                  f"needs ImageFolder shards)")
        if self.split not in manifest.splits:
            raise BenchUsageError(f"--split {self.split}: --shards {self.shards} has no such split (has: "
                                  f"{', '.join(manifest.splits)})")
        known = DETECTION_LOADERS if self.task == "detection" else LOADERS
        if self.task == "detection" and self.loaders == list(LOADERS):  # the default list: the detection ones
            self.loaders = list(DETECTION_LOADERS)
        if not self.loaders:
            raise BenchUsageError(f"--loaders: none given (choose from {', '.join(known)})")
        unknown = [name for name in self.loaders if name not in known]
        if unknown:
            raise BenchUsageError(f"--loaders: unknown {', '.join(unknown)} for --task {self.task} (choose from "
                                  f"{', '.join(known)})")
        if self.task == "detection" and self.model:
            raise BenchUsageError("--model times classification models; it does not apply to --task detection")
        for name, value in (("--batch-size", self.batch_size), ("--repeats", self.repeats),
                            ("--workers", self.workers), ("--image-size", self.image_size),
                            ("--epochs", 1 if self.epochs is None else self.epochs),
                            ("--model-steps", self.model_steps)):
            if value < 1:
                raise BenchUsageError(f"{name} must be >= 1, got {value}")
        if self.seconds is not None and not self.seconds > 0:
            raise BenchUsageError(f"--seconds must be > 0, got {self.seconds}")
        if self.warmup_batches < 0:
            raise BenchUsageError(f"--warmup must be >= 0, got {self.warmup_batches}")
        problem = output_folder_problem("--out", self.out)
        if problem:
            raise BenchUsageError(problem)
        if self.model:
            self.check_model()
        if not 0 <= self.hw_decoder_load <= 1:
            raise BenchUsageError(f"--hw-decoder-load must be in [0, 1], got {self.hw_decoder_load}")
        if not 0 <= self.random_erase <= 1:
            raise BenchUsageError(f"--random-erase must be in [0, 1], got {self.random_erase}")
        if self.task == "detection" and (self.auto_augment or self.random_erase or self.preview):
            raise BenchUsageError("--auto-augment, --random-erase and --preview apply to --task classify")
        if self.preview < 0:
            raise BenchUsageError(f"--preview must be >= 0, got {self.preview}")
        if self.task == "detection" and self.fp16:
            raise BenchUsageError("--fp16 applies to --task classify (the detection loaders hand out float32 lists)")
        images = manifest.num_samples(self.split)
        if images < self.batch_size:  # the torch loaders drop partial batches: they would never yield one
            raise BenchUsageError(f"--shards split {self.split!r} holds {images} images, fewer than one batch of "
                                  f"--batch-size {self.batch_size}: use --batch-size {images} or less, or more images")
        if self.task == "detection":
            problem = same_coco_data_problem(self.images, self.annotations, manifest, self.split)
        else:
            problem = same_data_problem(self.imagefolder, manifest, self.split)
        if problem and not self.allow_different_data:
            raise BenchUsageError(f"not the same data, so the race would compare nothing: {problem}; point both at "
                                  f"the same images (or pass --allow-different-data)")

    def check_model(self) -> None:
        """--model exists and takes --image-size in batches of --batch-size: checked on the meta device before any
        loader is timed."""
        from dalifeed.train.models import ModelError, check_input_size

        try:
            check_input_size(self.model, self.image_size, batch_size=self.batch_size)
        except ModelError as e:
            raise BenchUsageError(str(e)) from None

    def validate_detection_source(self) -> None:
        for name, path in (("--images", self.images), ("--annotations", self.annotations)):
            if path is None:
                raise BenchUsageError(f"--task detection needs {name} (the COCO data the shards were made from)")
            if not path.exists():
                raise BenchUsageError(f"{name} {path}: does not exist")

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
        "cores": usable_cores(), "cpu": cpu, "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """Time every loader (and, with a model, training fed by it); returns the JSON-ready report."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images = open_shard_folder(cfg.shards).num_samples(cfg.split)
    batches = max(1, cfg.epochs * images // cfg.batch_size) if cfg.epochs else None
    records, model_records = [], {}
    for name in cfg.loaders:
        if name in GPU_LOADERS and device.type != "cuda":
            log(f"{name}: skipped (no GPU)")
            continue
        if name == "webdataset" and is_s3_url(cfg.shards):
            log(f"{name}: skipped (plain webdataset reads s3:// only through a pipe: command; not measured)")
            continue
        window = f"{cfg.epochs} epoch(s)" if batches else f"{cfg.seconds:g} s"
        eta = f" (about {cfg.repeats * cfg.seconds + 5:.0f} s)" if not batches else ""
        log(f"{name}: warming up, then {cfg.repeats} x {window}{eta} ...")
        if cfg.task == "detection":
            loader = build_detection_loader(name, images=cfg.images, annotations=cfg.annotations, shards=cfg.shards,
                                            split=cfg.split, batch_size=cfg.batch_size, image_size=cfg.image_size,
                                            workers=cfg.workers, device=device, hw_decoder_load=cfg.hw_decoder_load)
        else:
            loader = on_device(build_loader(name, imagefolder=cfg.imagefolder, shards=cfg.shards, split=cfg.split,
                                            batch_size=cfg.batch_size, image_size=cfg.image_size,
                                            workers=cfg.workers, device=device, fp16=cfg.fp16,
                                            hw_decoder_load=cfg.hw_decoder_load, augment=cfg.augment()), device)
        timing = time_loader(loader, device, warmup_batches=cfg.warmup_batches, seconds=None if batches else cfg.seconds,
                             batches=batches, repeats=cfg.repeats, cores=usable_cores())
        record = {"loader": name, "images_per_s": timing.median, "images_per_s_runs": timing.images_per_s,
                  "cpu_percent": timing.cpu_percent, "peak_rss_mb": timing.peak_rss_mb, "output": timing.output}
        log(f"{name}: {timing.median:.0f} images/s (runs: {', '.join(f'{r:.0f}' for r in timing.images_per_s)})")
        if cfg.model:
            record.update(measure_model(cfg, loader, device, model_records, log, name))
        records.append(record)
        del loader
    base = next((r["images_per_s"] for r in records if r["loader"] == "baseline"), None)
    for r in records:
        r["speedup_vs_baseline"] = r["images_per_s"] / base if base else None
    return {"config": cfg.to_json(), "environment": environment(), "dataset": dataset_of(cfg, images),
            "results": records, "synthetic": model_records.get("synthetic")}


def dataset_of(cfg: BenchConfig, images: int) -> dict:
    manifest = open_shard_folder(cfg.shards)
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
            self.log(f"{self.what}: {total} steps, about {per_step * (total - 1):.0f} s more at {per_step:.1f} s a step")
        if done == total:
            self.bar.close()


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


# One colour per loader, the same in every plot, so that plots of different runs read alike.
LOADER_COLOURS = {"baseline": "#888888", "webdataset": "#4c72b0", "dali-cpu": "#9bd24a", "dali-hybrid": "#e69f00",
                  "dali-gpu": "#3d6b00"}


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(report: dict):
    """bench.png's figure: images/s per loader (median, min-max, speed-up over the baseline) and, with
    --model, the training steps/s each loader sustains next to synthetic data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    with_model = any("train_steps_per_s" in r for r in results)
    fig, axes = plt.subplots(1, 2 if with_model else 1, figsize=(12 if with_model else 7, 4.2), squeeze=False)
    names = [r["loader"] for r in results]
    colours = [LOADER_COLOURS.get(name, "#cccccc") for name in names]
    ax = axes[0][0]
    medians = [r["images_per_s"] for r in results]
    low = [m - min(r["images_per_s_runs"]) for m, r in zip(medians, results)]
    high = [max(r["images_per_s_runs"]) - m for m, r in zip(medians, results)]
    bars = ax.bar(names, medians, yerr=[low, high], capsize=4, color=colours)
    labels = [f"{r['images_per_s']:.0f}" + (f"\n{r['speedup_vs_baseline']:.2f}x" if r["speedup_vs_baseline"] else "")
              for r in results]
    ax.bar_label(bars, labels, padding=3, fontsize=9)
    ax.set_ylim(0, max(m + h for m, h in zip(medians, high)) * 1.3)  # room for the labels inside the frame
    ax.set_ylabel("images/s (median, bars: min-max)")
    ax.set_title("data loading")
    if with_model:
        ax2 = axes[0][1]
        rates = [r.get("train_steps_per_s", 0) for r in results]
        model_bars = ax2.bar(names, rates, color=colours)
        ax2.bar_label(model_bars, [f"{r.get('train_vs_synthetic', 0):.0%}" for r in results], padding=3, fontsize=9)
        synthetic = (report.get("synthetic") or {}).get("steps_per_s")
        if synthetic:
            ax2.axhline(synthetic, color="black", linestyle="--", linewidth=1)
            ax2.annotate("synthetic data", (0.01, synthetic), xycoords=("axes fraction", "data"), va="bottom",
                         fontsize=8)
        ax2.set_ylim(0, max(rates + [synthetic or 0]) * 1.3)
        ax2.set_ylabel("train steps/s (% of synthetic)")
        ax2.set_title(f"{(report.get('synthetic') or {}).get('model', 'model')} training fed by each loader")
    env, cfg, data = report["environment"], report["config"], report.get("dataset", {})
    fig.suptitle(f"{data.get('name', '?')} ({data.get('split', '?')}, {data.get('images', '?')} images), "
                 f"{cfg['image_size']} px, batch {cfg['batch_size']}; {env['gpu'] or 'CPU only'}, {env['cores']} cores",
                 fontsize=10)
    fig.tight_layout()
    return fig


def d(name: str):
    return default(BenchConfig, name)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--imagefolder", type=click.Path(path_type=Path), default=None,
              help="The ImageFolder tree the baseline reads (the split's own folder, e.g. SRC/train).")
@click.option("--task", type=click.Choice(["classify", "detection"]), default=d("task"), show_default=True,
              help="detection: race make_detection_loader (IoU crop, flip, resize to --image-size square, boxes) "
                   "against a torchvision DataLoader with transforms.v2 (RandomIoUCrop, RandomHorizontalFlip, "
                   "Resize, SanitizeBoundingBoxes) on COCO shards; give --images and --annotations instead of "
                   "--imagefolder. Loaders: baseline, dali-cpu, dali-hybrid, dali-gpu.")
@click.option("--images", type=click.Path(path_type=Path), default=None,
              help="--task detection: the image folder the COCO shards were made from.")
@click.option("--annotations", type=click.Path(path_type=Path), default=None,
              help="--task detection: the instances file the COCO shards were made from.")
@click.option("--shards", type=LOCATION, required=True,
              help="The shard folder shard-convert made from the same images (checked: see below), or "
                   "s3://bucket/prefix: DALI then reads the tars from the store (docs/storage.md).")
@click.option("--loaders", default=",".join(d("loaders")), show_default=True,
              help="Comma-separated subset to run. dali-hybrid and dali-gpu are skipped without a GPU.")
@click.option("--split", default=d("split"), show_default=True)
@click.option("--batch-size", type=int, default=d("batch_size"), show_default=True)
@click.option("--image-size", type=int, default=d("image_size"), show_default=True)
@click.option("--seconds", type=float, default=d("seconds"), show_default=True, help="Length of each timed run.")
@click.option("--epochs", type=int, default=d("epochs"), help="Time whole passes over the split instead of --seconds.")
@click.option("--repeats", type=int, default=d("repeats"), show_default=True,
              help="Timed runs per loader (median reported).")
@click.option("--warmup", "warmup_batches", type=int, default=d("warmup_batches"), show_default=True,
              help="Untimed batches first.")
@click.option("--workers", type=int, default=d("workers"), show_default=True,
              help="DataLoader workers and DALI threads alike: the same cores for everyone.")
@click.option("--fp16", is_flag=True, help="Every loader hands out float16 batches (what an AMP model consumes).")
@click.option("--hw-decoder-load", type=float, default=d("hw_decoder_load"), show_default=True,
              help="dali-gpu (classify and detection): share of the JPEGs given to the hardware JPEG decoder of "
                   "A100/H100-class GPUs (the "
                   "rest decode on CUDA cores); the best value depends on the GPU and the cores (make gpu-check "
                   "measures 0, 0.65 and 0.99).")
@click.option("--model", default=d("model"), help="Also time training steps of this torchvision model per loader, "
                                                  "against synthetic on-device data (e.g. resnet50).")
@click.option("--model-steps", type=int, default=d("model_steps"), show_default=True)
@click.option("--auto-augment", type=click.Choice(POLICIES), default=d("auto_augment"),
              help="Race with this policy in every loader: the DALI graph's, torchvision's transforms.v2 in the torch "
                   "ones (imagenet = AutoAugment, ra = RandAugment, ta_wide = TrivialAugmentWide).")
@click.option("--random-erase", type=float, default=d("random_erase"), show_default=True, metavar="P",
              help="Race with random erasing (probability P) in every loader.")
@click.option("--preview", type=int, default=d("preview"), show_default=True, metavar="N",
              help="Also write OUT/preview.png: N training samples of the shards, DALI's output beside "
                   "torchvision's for the same augmentation.")
@click.option("--allow-different-data", is_flag=True,
              help="Race even when --imagefolder and --shards do not hold the same files (the numbers then "
                   "compare different work).")
@click.option("--out", type=click.Path(path_type=Path), default=d("out"), show_default=True,
              help="Folder for bench.json, bench.png and config.json.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def main(debug: bool, **options):
    """Race the DALI pipelines against the torch DataLoader baseline on the same images and augmentation
    (RandomResizedCrop + flip + normalise to float batches on the model's device).

    \b
    Loaders:
      baseline    torchvision ImageFolder + DataLoader (workers = cores, uint8 collate, pinned memory,
                  normalise on the device, persistent workers, prefetch) -- the fair baseline
      webdataset  plain webdataset over the shards + DataLoader, same transform
      dali-cpu    dalifeed's DALI pipeline on the CPU
      dali-hybrid the same graph decoding on the CPU, cropping/resizing/normalising on the GPU (GPU only)
      dali-gpu    the same graph decoding with nvJPEG on the GPU, everything on the GPU (GPU only)

    \b
    Example:
      dali-bench --imagefolder /data/imagenet/train --shards /data/imagenet-shards --model resnet50

    Before timing anything it checks that --imagefolder holds the files the shards' split was made from
    (shard-convert records their names and sizes), that the split holds at least one batch and that --model
    takes --image-size (built on the meta device, as dali-train builds it); any failing is one line and
    exit 2. Reports images/s (median of --repeats), speed-up over baseline measured in the same run, CPU
    use and peak memory, and with --model the training steps/s each loader sustains against synthetic
    data (with a time estimate after the first step); writes OUT/bench.json, OUT/bench.png and
    OUT/config.json.
    """
    options["loaders"] = [name.strip() for name in options["loaders"].split(",") if name.strip()]
    if options["epochs"] is not None:
        options["seconds"] = None
    cfg = BenchConfig(**options)

    def bench() -> dict:
        cfg.validate()
        click.echo(f"dali-bench: {json.dumps(cfg.to_json())}", err=True)
        try:
            cfg.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BenchUsageError(folder_not_created("--out", cfg.out, e)) from None
        write_json_atomic(cfg.out / "config.json", cfg.to_json())
        if cfg.preview:
            from dalifeed.pipelines.preview import write_preview

            write_preview(cfg.shards, cfg.out / "preview.png", cfg.preview, cfg.augment() or
                          AugmentConfig(image_size=cfg.image_size), split=cfg.split)
            click.echo(f"wrote {cfg.out / 'preview.png'}", err=True)
        report = run_bench(cfg, log=lambda msg: click.echo(msg, err=True))
        write_json_atomic(cfg.out / "bench.json", report)
        plot(report, cfg.out / "bench.png")
        return report

    report = run_command(bench, debug=debug, usage_errors=(BenchUsageError,),
                         runtime_errors=(ShardDataError, StorageError),
                         log=lambda: cfg.out / "bench-error.log" if cfg.out.is_dir() else None,
                         stopped=lambda e: "nothing was written")
    click.echo(render_table(report))
    click.echo(f"\nwrote {cfg.out / 'bench.json'} and {cfg.out / 'bench.png'}", err=True)


if __name__ == "__main__":
    sys.exit(main())
