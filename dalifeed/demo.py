"""`make demo`: real images in, trained model and benchmark out, with the commands a user would type.

1. scikit-learn's 1,797 handwritten digits -> ImageFolder (train/ + val/) -> `shard-convert`
2. ImageNet-like photos from scikit-image/scikit-learn -> `shard-convert` -> `dali-bench`
3. `dali-train` on the digit shards (CPU here, GPU where there is one) -> validation accuracy
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from dalifeed.tools.sample_data import make_digits_imagefolder, make_photos_imagefolder

BIN = Path(sys.executable).parent  # the console scripts installed beside this Python


def run(*args: str) -> None:
    command = [str(BIN / args[0]), *args[1:]]
    click.secho(f"$ {shlex.join([args[0], *args[1:]])}", fg="cyan", err=True)
    subprocess.run(command, check=True)


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("build/demo"), show_default=True)
@click.option("--epochs", type=int, default=10, show_default=True)
@click.option("--bench-seconds", type=float, default=2.0, show_default=True)
def main(workdir: Path, epochs: int, bench_seconds: float) -> None:
    """Run the dalifeed demo end to end in WORKDIR (re-runnable: it starts clean each time)."""
    started = time.time()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)

    click.secho("== 1. digits: scikit-learn's handwritten digits as an ImageFolder, then shards", bold=True, err=True)
    digits = make_digits_imagefolder(workdir / "digits", size=32)
    run("shard-convert", "imagefolder", str(digits), str(workdir / "digits-shards"))
    run("shard-convert", "verify", str(workdir / "digits-shards"), "--decode")

    click.secho("== 2. photos: ImageNet-like 500x375 JPEGs, shards, and the loader race", bold=True, err=True)
    photos = make_photos_imagefolder(workdir / "photos", per_class=60)
    run("shard-convert", "imagefolder", str(photos), str(workdir / "photos-shards"), "--samples-per-shard", "32")
    run("dali-bench", "--imagefolder", str(photos / "train"), "--shards", str(workdir / "photos-shards"),
        "--seconds", str(bench_seconds), "--repeats", "3", "--out", str(workdir / "bench"))

    click.secho("== 3. train: ResNet-18 on the digit shards, fed by DALI", bold=True, err=True)
    run_dir = workdir / "run"
    run("dali-train", "--data", str(workdir / "digits-shards"), "--out", str(run_dir), "--model", "resnet18",
        "--epochs", str(epochs), "--batch-size", "64", "--lr", "0.2", "--warmup-epochs", "1",
        "--weight-decay", "5e-4", "--image-size", "32", "--crop-scale", "0.5,1", "--no-flip")

    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    bench = json.loads((workdir / "bench" / "bench.json").read_text())["results"]
    click.secho("\n== dalifeed demo: results", bold=True)
    click.echo(f"digits validation: top-1 {final['top1']:.2%}, top-5 {final['top5']:.2%} over "
               f"{final['val_samples']} images after {final['epoch'] + 1} epochs "
               f"({final['images_per_s']:.0f} train images/s, data wait {final['data_wait_share']:.0%} of step time)")
    for r in bench:
        click.echo(f"loader {r['loader']:<10} {r['images_per_s']:7.0f} images/s  x{r['speedup_vs_baseline']:.2f} baseline")
    click.echo(f"outputs: {workdir}/run (metrics.jsonl, best.pt), {workdir}/bench (bench.json, bench.png)")
    click.echo(f"demo took {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
