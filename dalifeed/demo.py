"""`make demo`: real images in, trained model and benchmark out, with the commands a user would type.

1. scikit-learn's 1,797 handwritten digits -> ImageFolder (train/ + val/) -> `shard-convert`
2. ImageNet-like photos from scikit-image/scikit-learn -> `shard-convert` -> `dali-bench` (the baseline
   DataLoader against dali-cpu, timed as the long bench times them: see BENCH)
3. `dali-train` on the digit shards (CPU here, GPU where there is one) -> validation accuracy
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import click

from dalifeed.bench.sample_data import make_digits_imagefolder, make_photos_imagefolder
from dalifeed.runtime import usable_cores


class Steps:
    """Runs the commands a user would type, and remembers how long each part of the demo took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._part, self._since = "", time.time()

    def part(self, name: str, title: str) -> None:
        self._close()
        self._part = name
        click.secho(f"== {title}", bold=True, err=True)

    def run(self, *args: str) -> None:
        """`args` as typed at a shell, run by the console script's own function in this process: the same
        code, options and output as the installed command, without a new interpreter importing torch,
        torchvision and DALI again for each command (seconds at every start). A command
        that fails has printed its one line: the demo stops with its exit code."""
        click.secho(f"$ {shlex.join(args)}", fg="cyan", err=True)
        (script,) = entry_points(group="console_scripts", name=args[0])
        saved, sys.argv = sys.argv, list(args)
        try:
            script.load()()
        except SystemExit as e:  # click's commands end with sys.exit, 0 included
            if e.code not in (0, None):
                raise
        finally:
            sys.argv = saved

    def _close(self) -> None:
        now = time.time()
        if self._part:
            self.seconds[self._part] = now - self._since
        self._since = now

    def summary(self) -> str:
        self._close()
        return ", ".join(f"{name} {s:.0f} s" for name, s in self.seconds.items())


# The digits recipe. ResNet-10 (resnet10_cifar) reaches ResNet-18's accuracy over seeds and CPU kernels
# (AVX-512, AVX2, SSE4.1) with one block a stage, so the demo ends sooner (docs/training.md, "Measured").
# - The digits are framed by a 2-pixel black margin (12x12, as MNIST centres its digits in a box; see
#   make_digits_imagefolder) and trained at 16 px by a ResNet with a CIFAR stem (3x3 stride-1 convolution, no
#   max-pool) at width 16 (stages 16..128 channels), one basic block a stage. torchvision's stem (7x7 stride 2,
#   then a max-pool) shrinks 32 px to 8x8 before the first stage; this one keeps 16x16 there.
# - The margin matters: without it the digits touch their top and bottom rows, and the random crops (and
#   validation's centre crop) cut strokes off them.
# - batch 64 at lr 0.4 per 256 (SGD, Nesterov, label smoothing 0.1, weight decay 5e-4), 1 warm-up epoch,
#   30 epochs, crops of scale 0.35-1, no flips (a flipped digit is another glyph).
RECIPE = ["--model", "resnet10_cifar", "--width", "16", "--image-size", "16", "--crop-scale", "0.35,1", "--no-flip",
          "--batch-size", "64", "--lr", "0.4", "--warmup-epochs", "1", "--weight-decay", "5e-4"]


# The demo's race: what `dali-bench` measures with its default windows, in less time. A timed window must
# not begin with batches made before it (dali-bench's warm-up drains each loader's read-ahead, which would
# make a short window look faster), and it takes dali-bench's default batch of 64, as the long bench it stands
# for: on the demo's few training photos the batch size changes how evenly a DataLoader's workers share an
# epoch (it hands them batches in turn), so the baseline must be timed at the bench's batch. `make bench` races
# every loader and the peers (docs/benchmarks.md).
BENCH = ["--seconds", "2", "--repeats", "3", "--loaders", "baseline,dali-cpu"]


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("build/demo"), show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="dali-train's seed (weights, order, crops).")
@click.option("--epochs", type=int, default=30, show_default=True)
def main(workdir: Path, seed: int, epochs: int) -> None:
    """Run the dalifeed demo end to end in WORKDIR (re-runnable: it starts clean each time)."""
    started = time.time()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)

    steps = Steps()
    steps.part("digits", "1. digits: scikit-learn's handwritten digits as an ImageFolder, then shards")
    digits = make_digits_imagefolder(workdir / "digits", size=32, margin=2)
    steps.run("shard-convert", "imagefolder", str(digits), str(workdir / "digits-shards"))
    steps.run("shard-convert", "verify", str(workdir / "digits-shards"), "--decode")

    steps.part("bench", "2. photos: ImageNet-like 500x375 JPEGs, shards, and the loader race")
    # a process per core writes the photos (the same files as one: each class has its own seeded generator),
    # sooner on several cores
    photos = make_photos_imagefolder(workdir / "photos", per_class=32, workers=usable_cores())
    steps.run("shard-convert", "imagefolder", str(photos), str(workdir / "photos-shards"), "--samples-per-shard", "32")
    steps.run("dali-bench", "--imagefolder", str(photos / "train"), "--shards", str(workdir / "photos-shards"),
              *BENCH, "--out", str(workdir / "bench"))

    steps.part("train", "3. train: ResNet-10 (CIFAR stem) on the digit shards, fed by DALI")
    run_dir = workdir / "run"
    steps.run("dali-train", "--data", str(workdir / "digits-shards"), "--out", str(run_dir), *RECIPE,
              "--epochs", str(epochs), "--seed", str(seed))

    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    bench = json.loads((workdir / "bench" / "bench.json").read_text())["results"]
    click.secho("\n== dalifeed demo: results", bold=True)
    click.echo(f"digits validation: top-1 {final['top1']:.2%}, top-5 {final['top5']:.2%} over "
               f"{final['val_samples']} images after {final['epoch'] + 1} epochs "
               f"({final['images_per_s']:.0f} train images/s, data wait {final['data_wait_share']:.0%} of step time)")
    for r in bench:
        click.echo(f"loader {r['loader']:<10} {r['images_per_s']:7.0f} images/s  "
                   f"x{r['speedup_vs_baseline']:.2f} baseline")
    click.echo(f"outputs: {workdir}/run (metrics.jsonl, best.pt), {workdir}/bench (bench.json, bench.png)")
    click.echo(f"demo: seed {seed}, top-1 {final['top1']:.2%}, {time.time() - started:.0f} s ({steps.summary()})")


if __name__ == "__main__":
    main()
