"""`make bench`: build the ImageNet-like photo set, measure conversion and loaders, rewrite docs/benchmarks.md.

    python -m dalifeed.bench.make_bench --workdir build/bench --doc docs/benchmarks.md

The generated part of the document sits between the markers below; the text around it is kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from . import convert_rate, stages
from .config import BenchConfig
from .names import LOADERS, PEERS
from .peers import missing_package
from .photos import build_data
from .report import render_table, write_report
from .run import run_bench

BEGIN, END = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"


def render(convert: dict, bench: dict, stage: dict[str, float], command: str) -> str:
    env = bench["environment"]
    cfg = bench["config"]
    baseline = next((r["images_per_s"] for r in bench["results"] if r["loader"] == "baseline"), None)
    lines = [
        BEGIN,
        f"Measured {env['date']} with `{command}` on {env['cores']} cores ({env['cpu']}), "
        f"GPU: {env['gpu'] or 'none'}; torch {env['torch']}, torchvision {env['torchvision']}, DALI {env['dali']}.",
        "",
        "### shard-convert against pure decode",
        "",
        convert_rate.render_markdown(convert),
        "",
        "### Loaders: same images, same augmentation, same cores",
        "",
        f"RandomResizedCrop({cfg['image_size']}) + flip + normalise to float batches, batch {cfg['batch_size']}, "
        f"{cfg['workers']} DataLoader workers / DALI threads, {cfg['repeats']} timed runs of {cfg['seconds']} s "
        f"after {cfg['warmup_batches']} warm-up batches and each loader's read-ahead; median and min-max.",
        "",
        render_table(bench),
        "",
        f"Pure decode of the same files on the same cores (PIL, full decode, no augmentation): "
        f"{convert['decode_images_per_s']:.0f} images/s.",
        "",
        "### What limits dali-cpu",
        "",
        f"The same DALI graph cut after each stage, {cfg['workers']} threads, DALI alone (no PyTorch iterator):",
        "",
        stages.render_markdown(stage, baseline),
        END,
    ]
    return "\n".join(lines)


def update_doc(doc: Path, section: str) -> None:
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def race_loaders(log) -> list[str]:
    """Every loader, and the peers (bench/peers) whose packages are here: `make bench` installs them."""
    peers = []
    for name in PEERS:
        problem = missing_package(name)
        if problem:
            log(f"{name}: left out of the race ({problem})")
        else:
            peers.append(name)
    return list(LOADERS) + peers


@click.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("build/bench"), show_default=True)
@click.option("--doc", type=click.Path(path_type=Path), default=Path("docs/benchmarks.md"), show_default=True)
@click.option("--per-class", type=int, default=300, show_default=True, help="Photos per class (8 classes).")
@click.option("--seconds", type=float, default=10.0, show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--model", default=None, help="Also time training steps of this model (slow on a CPU).")
def main(workdir: Path, doc: Path, per_class: int, seconds: float, repeats: int, model: str | None) -> None:
    """Build the ImageNet-like photos, convert them, measure conversion and all loaders, update DOC."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    click.echo(f"building {per_class} photos per class in {workdir} ...", err=True)
    photos, shards = build_data(workdir, per_class)
    click.echo("measuring shard-convert against pure decode ...", err=True)
    convert = convert_rate.measure(photos, workdir, repeats=repeats)
    click.echo(convert_rate.render_markdown(convert))
    cfg = BenchConfig(imagefolder=photos / "train", shards=shards, out=workdir / "loaders", seconds=seconds,
                      repeats=repeats, model=model, loaders=race_loaders(lambda msg: click.echo(msg, err=True)))
    dataset = cfg.validate()
    bench = run_bench(cfg, dataset, log=lambda msg: click.echo(msg, err=True))
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_report(bench, cfg.out)
    (workdir / "convert_rate.json").write_text(json.dumps(convert, indent=2) + "\n")
    click.echo(render_table(bench))
    click.echo("measuring the DALI pipeline stage by stage ...", err=True)
    stage = stages.stage_rates(dataset.manifest, batch_size=cfg.batch_size, threads=cfg.workers,
                               image_size=cfg.image_size, device="gpu" if bench["environment"]["gpu"] else "cpu")
    (workdir / "stages.json").write_text(json.dumps(stage, indent=2) + "\n")
    command = "make bench" if os.environ.get("MAKELEVEL") else "python -m dalifeed.bench.make_bench"
    update_doc(doc, render(convert, bench, stage, command))
    click.echo(f"\nupdated {doc}; raw results in {workdir} ({time.time() - started:.0f} s)", err=True)


if __name__ == "__main__":
    main()
