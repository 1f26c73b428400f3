"""`dali-bench`: the DALI pipelines against a tuned torch DataLoader, same data, same augmentation.

The click command only: the options become a `BenchConfig` (config.py), `run_bench` (run.py) races the
loaders, `report.py` renders and writes their results."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import click

from dalifeed.atomic import write_json_atomic
from dalifeed.cliutil import LOCATION, default, run_command, size_option
from dalifeed.pipelines.checks import OpenFileLimit, ShardDataError
from dalifeed.pipelines.names import POLICIES
from dalifeed.s3 import StorageError
from dalifeed.stack import StackMismatch
from dalifeed.usage import folder_not_created

from .config import BenchConfig, BenchUsageError
from .report import render_table, write_report

# run.py (the race) imports torch and DALI: imported where a race starts, so that --help shows at once


def d(name: str):
    return default(BenchConfig, name)


def parse_image_sizes(ctx, param, value: str) -> list[int]:
    """--image-size 224, or several (160,192): the race at each, e.g. a --progressive-resize schedule's sizes."""
    try:
        sizes = [int(part) for part in str(value).split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: one size in pixels, or several separated by commas (160,192)") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r}: sizes must be >= 1 pixel")
    return sizes


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--imagefolder", type=click.Path(path_type=Path), default=None,
              help="The ImageFolder tree the baseline reads (the split's own folder, e.g. SRC/train). Needed only "
                   "when the baseline runs: the other loaders read --shards (e.g. shards adopted with "
                   "shard-convert index, which have no ImageFolder).")
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
                   "s3://bucket/prefix: each tar is then fetched whole into the node's shard cache and DALI reads it "
                   "there (docs/storage.md).")
@click.option("--loaders", default=",".join(d("loaders")), show_default=True,
              help="Comma-separated subset to run. dali-hybrid and dali-gpu are skipped without a GPU (exit 2 "
                   "when no loader given can run here). Also: the peers spdl, streaming, litdata (not run unless "
                   "named; pip install 'dalifeed[peers]').")
@click.option("--split", default=d("split"), show_default=True)
@click.option("--batch-size", type=int, default=d("batch_size"), show_default=True)
@click.option("--image-size", default=str(d("image_size")), show_default=True, callback=parse_image_sizes,
              help="Output size in pixels; several (160,192: what a --progressive-resize schedule trains at) race "
                   "the loaders at each, into OUT/<size>px/, with OUT/sizes.json beside.")
@click.option("--seconds", type=float, default=d("seconds"), show_default=True, help="Length of each timed run.")
@click.option("--epochs", type=int, default=d("epochs"), help="Time whole passes over the split instead of --seconds.")
@click.option("--repeats", type=int, default=d("repeats"), show_default=True,
              help="Timed runs per loader (median reported).")
@click.option("--warmup", "warmup_batches", type=int, default=d("warmup_batches"), show_default=True,
              help="Untimed batches first, then as many as the loader holds ready (a DataLoader's workers x "
                   "prefetch_factor, DALI's prefetch queue), so that no timed run counts batches made before it.")
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
@click.option("--allow-different-data", is_flag=True,
              help="Race even when --imagefolder and --shards do not hold the same files (the numbers then "
                   "compare different work).")
@click.option("--out", type=click.Path(path_type=Path), default=d("out"), show_default=True,
              help="Folder for bench.json, bench.png and config.json (and the peers' copies of the data, in "
                   "OUT/peers, kept for the next run).")
@click.option("--auto-augment", type=click.Choice(POLICIES), default=d("auto_augment"),
              help="Race with this policy in every loader: the DALI graph's, torchvision's transforms.v2 in the torch "
                   "ones (imagenet = AutoAugment, ra = RandAugment, ta_wide = TrivialAugmentWide).")
@click.option("--random-erase", type=float, default=d("random_erase"), show_default=True, metavar="P",
              help="Race with random erasing (probability P) in every loader.")
@click.option("--preview", type=int, default=d("preview"), show_default=True, metavar="N",
              help="Also write OUT/preview.png: N training samples of the shards, DALI's output beside "
                   "torchvision's for the same augmentation.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="--shards s3://...: the shard cache the DALI loaders fetch whole tars into [default: shards/ in "
                   "dalifeed's cache folder].")
@click.option("--cache-limit", default=None, metavar="SIZE", callback=size_option,
              help="--shards s3://...: bound of the shard cache, e.g. 20GB (20*10^9 bytes) or 20GiB (20*2^30) "
                   "[default: 90% of the free space].")
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
    Peers (named in --loaders only; the `peers` extra), each reading its own copy of the split in its own format,
    written once under OUT/peers, same augmentation, batch, cores and output (docs/benchmarks.md, "The race"):
      spdl        SPDL's thread pipeline over the shard tars, spdl.io decoding (needs FFmpeg's shared libraries)
      streaming   Mosaic streaming: MDSWriter shards, StreamingDataset + DataLoader
      litdata     LitData: litdata.optimize chunks, StreamingDataset + StreamingDataLoader

    \b
    Example:
      dali-bench --imagefolder /data/imagenet/train --shards /data/imagenet-shards --model resnet50

    Before timing anything it checks that --imagefolder (when the baseline runs) holds the files the shards'
    split was made from (shard-convert records their names and sizes), that the split holds at least one
    batch, that at least one loader can run here and that --model takes --image-size (built on the meta
    device, as dali-train builds it); any failing is one line and exit 2, as is a node whose NVIDIA GPUs the
    installed torch or DALI cannot use (`dalifeed doctor`). Reports images/s (median of --repeats), speed-up
    over baseline measured in the same run, CPU use, peak memory and the epoch start (the wait for an epoch's
    first batch, in batch times), and with --model the training steps/s each loader sustains against synthetic
    data (with a time estimate after the first step); writes OUT/bench.json, OUT/bench.png and OUT/config.json.
    """
    options["loaders"] = [name.strip() for name in options["loaders"].split(",") if name.strip()]
    if options["epochs"] is not None:
        options["seconds"] = None
    sizes = options.pop("image_size")
    cfg = BenchConfig(**options, image_size=sizes[0])
    # one config per size, each into its own folder when there are several: the same data, opened once
    races = [cfg] if len(sizes) == 1 else [replace(cfg, image_size=size, out=cfg.out / f"{size}px") for size in sizes]

    def bench() -> list[dict]:
        from dalifeed.pipelines.augment import AugmentConfig

        from .run import run_bench

        dataset = cfg.validate()  # --shards opened once, for every loader and size
        if dataset.sources[0].manifest.tar_root is not None:
            click.echo(f"--shards {cfg.shards}: its manifest reads the tars from "
                       f"{dataset.sources[0].manifest.tar_root} (indexed with --index-dir)", err=True)
        for race in races[1:]:
            if race.model:  # the model must take every size
                race.check_model()
        reports = []
        for race in races:
            click.echo(f"dali-bench: {json.dumps(race.to_json())}", err=True)
            try:
                race.out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BenchUsageError(folder_not_created("--out", race.out, e)) from None
            write_json_atomic(race.out / "config.json", race.to_json())
            if race.preview:
                from dalifeed.pipelines.preview import write_preview

                write_preview(dataset.manifest, race.out / "preview.png", race.preview, race.augment() or
                              AugmentConfig(image_size=race.image_size), split=race.split)
                click.echo(f"wrote {race.out / 'preview.png'}", err=True)
            report = run_bench(race, dataset, log=lambda msg: click.echo(msg, err=True))
            write_report(report, race.out)
            reports.append(report)
        if len(races) > 1:
            write_json_atomic(cfg.out / "sizes.json", sizes_summary(sizes, reports))
        return reports

    with own_temp_folder():
        reports = run_command(bench, debug=debug, usage_errors=(BenchUsageError, StackMismatch),
                              runtime_errors=(ShardDataError, OpenFileLimit, StorageError),
                              log=lambda: cfg.out / "bench-error.log" if cfg.out.is_dir() else None,
                              stopped=lambda e: "nothing was written")
    for race, report in zip(races, reports):
        if len(races) > 1:
            click.echo(f"\n{race.image_size} px:")
        click.echo(render_table(report))
        click.echo(f"\nwrote {race.out / 'bench.json'} and {race.out / 'bench.png'}", err=True)
    if len(races) > 1:
        click.echo(f"wrote {cfg.out / 'sizes.json'}", err=True)


@contextmanager
def own_temp_folder():
    """The race's temporary files (the DataLoader workers' pymp-*, torch's inductor cache, the peers' chunks and
    file locks) in a folder of its own, removed when the race ends, and those a killed race left (named by its
    pid) when the next one starts; $TMPDIR as it was."""
    remove_dead_races_folders(Path(tempfile.gettempdir()))
    # short: sockets in it (pymp-*/listener-*) must fit AF_UNIX's 107 bytes
    folder = tempfile.mkdtemp(prefix=f"db{os.getpid()}-")
    saved_env, saved_default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder  # child processes inherit the variable
    try:
        yield Path(folder)
    finally:
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        tempfile.tempdir = saved_default
        shutil.rmtree(folder, ignore_errors=True)


def remove_dead_races_folders(tmp: Path) -> None:
    """The temporary folders of races whose process is gone (a kill -9: nothing of it removed its folder)."""
    from dalifeed.runtime import pid_alive

    for folder in tmp.glob("db*-*"):
        pid = folder.name[2:].partition("-")[0]
        if folder.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def sizes_summary(sizes: list[int], reports: list[dict]) -> dict:
    """Each loader's throughput at each size, and what each size gives against the first (a schedule's saving)."""
    rates = {size: {r["loader"]: r["images_per_s"] for r in report["results"]} for size, report in zip(sizes, reports)}
    first = rates[sizes[0]]
    return {"image_sizes": sizes,
            "images_per_s": {str(size): rate for size, rate in rates.items()},
            "vs_first_size": {str(size): {name: rate[name] / first[name] for name in rate if first.get(name)}
                              for size, rate in rates.items()}}


if __name__ == "__main__":
    sys.exit(main())
