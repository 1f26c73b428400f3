"""COCO conversion rate against pure decode on the same files (the goal is >= 0.7x, as for ImageFolder):

    python -m dalifeed.bench.coco_rate --workdir build/coco-bench --per-class 100 --repeats 3

Builds `make_photos_coco` (ImageNet-like 500x375 photos with random boxes) once, then alternates a PIL decode
of every file with `shard-convert coco` of them, and prints the medians and the ratio as JSON.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import click

from dalifeed.bench.sample_data import make_photos_coco
from dalifeed.convert.coco import CocoConfig, convert_coco
from dalifeed.runtime import usable_cores

from .convert_rate import pure_decode_seconds


def convert_seconds(images: Path, annotations: Path, out: Path, workers: int) -> float:
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    # default shard size, as convert_rate measures ImageFolder: the rate of the conversion a user runs
    convert_coco(CocoConfig(images=[images], annotations=[annotations], out=out, workers=workers, progress=False))
    return time.perf_counter() - start


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("build/coco-bench"), show_default=True)
@click.option("--per-class", type=int, default=100, show_default=True, help="Photos per source photo (x ~12).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--workers", type=int, default=None, help="Default: the cores available.")
def main(workdir: Path, per_class: int, repeats: int, workers: int | None) -> None:
    workers = workers or usable_cores()
    images, annotations = workdir / "coco" / "images", workdir / "coco" / "instances_photos.json"
    if not annotations.is_file():
        images, annotations = make_photos_coco(workdir / "coco", per_class=per_class)
    files = sorted(str(p) for p in images.iterdir())
    decode, convert = [], []
    for _ in range(repeats):
        decode.append(len(files) / pure_decode_seconds(files, workers))
        convert.append(len(files) / convert_seconds(images, annotations, workdir / "shards", workers))
    click.echo(json.dumps({
        "images": len(files), "annotations": len(json.loads(annotations.read_text())["annotations"]),
        "workers": workers, "repeats": repeats, "decode_images_per_s": statistics.median(decode),
        "convert_images_per_s": statistics.median(convert),
        "convert_over_decode": statistics.median(c / d for c, d in zip(convert, decode)),
        "runs": {"decode": decode, "convert": convert},
    }, indent=2))


if __name__ == "__main__":
    main()
