"""The training/serving skew of a run, in accuracy and in speed: its export (`dalifeed export`: the run's DALI
validation graph, then the classifier in onnxruntime) against the preprocessing a serving team writes by hand
(PIL decoding, torchvision's Resize + CenterCrop + ToTensor + Normalize, then the same onnxruntime session), on
the run's validation split, on the CPU:

    python -m dalifeed.bench.serving_skew --run build/demo/run    # the run `make demo` trains

For each batch size (--batches, default 1, 8, 32): images a second through preprocessing + model, the median of
--repeats passes over the split after one pass of warm-up; both paths get --threads cores (DALI's threads; a thread pool
for PIL, which releases the GIL while it decodes and resizes) and onnxruntime the same. Then the top-1 each
path gives, how many predictions differ, and the mean absolute difference of their preprocessed pixels. Prints
a markdown table; writes the JSON record with the environment into --workdir.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

from dalifeed.cliutil import run_command
from dalifeed.runtime import DiskFull, usable_cores


def torchvision_preprocess(augment, threads: int):
    """encoded images -> (N, 3, H, W) float32 by PIL and torchvision's transforms, `threads` images at a time."""
    import torch
    import torchvision.transforms as T
    from PIL import Image

    transform = T.Compose([T.Resize(augment.val_shorter_side), T.CenterCrop(augment.image_size), T.ToTensor(),
                           T.Normalize(augment.mean, augment.std)])
    pool = ThreadPoolExecutor(threads)

    def one(data: bytes):
        return transform(Image.open(io.BytesIO(data)).convert("RGB"))

    def preprocess(encoded: list[bytes]) -> np.ndarray:
        return torch.stack(list(pool.map(one, encoded))).numpy()
    return preprocess


def images_per_s(preprocess, classify, encoded: list[bytes], batch: int, repeats: int) -> float:
    """The median over `repeats` timed passes over `encoded` in batches of `batch`, after one untimed pass."""
    chunks = [encoded[i:i + batch] for i in range(0, len(encoded), batch)]
    rates = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        for chunk in chunks:
            classify(preprocess(chunk))
        if attempt:  # the first pass warms up: thread pools, onnxruntime's arenas, DALI's buffers
            rates.append(len(encoded) / (time.perf_counter() - start))
    return statistics.median(rates)


def measure(run: Path, data: Path | None, split: str, batches: list[int], repeats: int, threads: int,
            workdir: Path, log=print) -> dict:
    import torch

    from dalifeed.bench.run import environment
    from dalifeed.export import ExportConfig, export_repository, load_run_weights
    from dalifeed.export.local import LocalRepository, split_images

    previous = torch.get_num_threads()  # the caller's, given back: a test process trains after this
    torch.set_num_threads(threads)
    try:
        found = load_run_weights(run)
        data = data or Path(found.config.data if isinstance(found.config.data, str) else found.config.data[0])
        repo = workdir / "repo"
        export_repository(ExportConfig(run=str(run), repo=str(repo), device="cpu", max_batch_size=max(batches),
                                       dali_threads=threads), log=log)
        local = LocalRepository(repo, num_threads=threads, intra_op_threads=threads)
        samples = list(split_images(data, split))
        encoded, labels = [s[1] for s in samples], np.array([s[2] for s in samples])
        reference = torchvision_preprocess(found.config.val_augment(), threads)
        paths = {"dalifeed export (DALI + onnxruntime)": local.preprocess,
                 "PIL + torchvision (+ onnxruntime)": reference}
        rows = []
        for name, preprocess in paths.items():
            images = np.concatenate([preprocess(encoded[i:i + max(batches)])
                                     for i in range(0, len(encoded), max(batches))])
            predictions = local.classify(images).argmax(1)
            rates = {b: images_per_s(preprocess, local.classify, encoded, b, repeats) for b in batches}
            rows.append({"path": name, "top1": float((predictions == labels).mean()), "images_per_s": rates,
                         "images": images, "predictions": predictions})
            log(f"{name}: top-1 {rows[-1]['top1']:.4f}, " + ", ".join(f"batch {b} {r:.0f} images/s"
                                                                      for b, r in rates.items()))
        ours, theirs = rows
        record = {
            "run": str(run), "weights": found.weights, "model": found.config.model, "data": str(data), "split": split,
            "images": len(encoded), "threads": threads, "repeats": repeats, "recorded_top1": found.top1,
            "paths": [{k: v for k, v in row.items() if k not in ("images", "predictions")} for row in rows],
            "predictions_differing": int((ours["predictions"] != theirs["predictions"]).sum()),
            "mean_abs_pixel_difference": float(np.abs(ours["images"] - theirs["images"]).mean()),
            "environment": environment(),
        }
        return record
    finally:
        torch.set_num_threads(previous)


def markdown(record: dict) -> str:
    batches = list(record["paths"][0]["images_per_s"])
    head = ("| preprocessing | top-1 | " + " | ".join(f"images/s at batch {b}" for b in batches) + " |\n"
            + "|---|---|" + "---|" * len(batches) + "\n")
    body = "".join(f"| {p['path']} | {p['top1']:.2%} | "
                   + " | ".join(f"{p['images_per_s'][b]:.0f}" for b in batches) + " |\n" for p in record["paths"])
    recorded = record["recorded_top1"]
    return (head + body + f"\n{record['model']} ({record['weights']} weights; dali-train recorded top-1 "
            + (f"{recorded:.2%}" if recorded is not None else "none") + f") on the {record['images']} images of "
            f"split {record['split']}, {record['threads']} cores ({record['environment']['cpu']}); "
            f"{record['predictions_differing']} predictions differ, mean absolute pixel difference "
            f"{record['mean_abs_pixel_difference']:.4f} (normalised units).\n")


@click.command()
@click.option("--run", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="A dali-train run folder (its default weights are exported).")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Its shard folder (default: the run's --data).")
@click.option("--split", default="val", show_default=True)
@click.option("--batches", default="1,8,32", show_default=True, callback=lambda ctx, param, value: batch_sizes(value),
              help="Batch sizes, comma-separated.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed passes over the split per batch size.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Cores for each path (default: every usable core).")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where the export and serving-skew.json go (default: a temporary folder).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def main(run: Path, data: Path | None, split: str, batches: list[int], repeats: int, threads: int | None,
         workdir: Path | None, debug: bool) -> None:
    """Print the skew table of RUN's export against PIL + torchvision preprocessing: per batch size, images a
    second through preprocessing + model (median of --repeats passes), each path's top-1, the predictions that
    differ, and the mean absolute difference of the preprocessed pixels."""
    from dalifeed.export import ExportError

    def body() -> None:
        with tempfile.TemporaryDirectory(prefix="serving-skew-") as tmp:
            folder = workdir or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            record = measure(run, data, split, batches, repeats, threads or usable_cores(), folder,
                             log=lambda line: click.echo(line, err=True))
            (folder / "serving-skew.json").write_text(json.dumps(record, indent=2) + "\n")
            click.echo(markdown(record))

    run_command(body, debug=debug, usage_errors=(ExportError,), runtime_errors=(DiskFull,))


def batch_sizes(value: str) -> list[int]:
    """--batches' comma-separated sizes, each >= 1 (click.BadParameter otherwise)."""
    try:
        sizes = [int(b) for b in value.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"batch sizes >= 1, comma-separated, such as 1,8,32; got {value!r}")
    return sizes


if __name__ == "__main__":
    main()
