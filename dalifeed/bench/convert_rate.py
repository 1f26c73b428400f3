"""How fast `shard-convert` runs next to the bare decode of the same files on the same cores.

Conversion decodes every image in full (to catch corrupt files), so its ceiling is the pure decode rate;
the ratio says what the sharding machinery (IPC, tar writing, hashing, indexes) costs on top.

    python -m dalifeed.bench.convert_rate SRC [--repeats 5] [--workers N] [--workdir DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from multiprocessing import get_context
from pathlib import Path

import click

from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.convert.images import decode_check
from dalifeed.runtime import usable_cores


def _decode_file(path: str) -> int:
    data = Path(path).read_bytes()
    decode_check(data)
    return len(data)


def pure_decode_seconds(files: list[str], workers: int) -> float:
    """Read + fully decode every file with PIL in `workers` processes; nothing else."""
    with get_context("spawn").Pool(workers) as pool:
        pool.map(_decode_file, files[: workers * 2])  # start-up and imports outside the timing
        start = time.perf_counter()
        for _ in pool.imap_unordered(_decode_file, files, chunksize=16):
            pass
        return time.perf_counter() - start


def convert_seconds(src: Path, out: Path, workers: int) -> float:
    if out.exists():
        shutil.rmtree(out)
    cfg = ConvertConfig(src=src, out=out, workers=workers, progress=False)
    start = time.perf_counter()
    convert_imagefolder(cfg)
    return time.perf_counter() - start


def measure(src: Path, workdir: Path, repeats: int = 5, workers: int | None = None) -> dict:
    """Median and spread of both rates over `repeats` alternating runs (alternating evens out drift)."""
    src, workdir = Path(src), Path(workdir)
    workers = workers or usable_cores()
    files = sorted(str(p) for p in src.rglob("*") if p.is_file())
    total_bytes = sum(os.path.getsize(f) for f in files)
    decode_s, convert_s = [], []
    for _ in range(repeats):
        decode_s.append(pure_decode_seconds(files, workers))
        convert_s.append(convert_seconds(src, workdir / "convert-rate-shards", workers))
    decode_rate = [len(files) / s for s in decode_s]
    convert_rate = [len(files) / s for s in convert_s]
    return {
        "images": len(files), "megabytes": total_bytes / 1e6, "workers": workers, "repeats": repeats,
        "decode_images_per_s": statistics.median(decode_rate),
        "decode_images_per_s_min_max": [min(decode_rate), max(decode_rate)],
        "convert_images_per_s": statistics.median(convert_rate),
        "convert_images_per_s_min_max": [min(convert_rate), max(convert_rate)],
        "convert_mb_per_s": statistics.median(total_bytes / 1e6 / s for s in convert_s),
        "convert_over_decode": statistics.median(c / d for c, d in zip(convert_rate, decode_rate)),
    }


def render_markdown(r: dict) -> str:
    lo_d, hi_d = r["decode_images_per_s_min_max"]
    lo_c, hi_c = r["convert_images_per_s_min_max"]
    return "\n".join([
        f"{r['images']} files, {r['megabytes']:.1f} MB, {r['workers']} worker processes, "
        f"median of {r['repeats']} alternating runs (min-max in brackets).",
        "",
        "| | images/s | MB/s |",
        "|---|---|---|",
        f"| pure decode (read + PIL full decode) | {r['decode_images_per_s']:.0f} [{lo_d:.0f}-{hi_d:.0f}] | "
        f"{r['decode_images_per_s'] * r['megabytes'] / r['images']:.1f} |",
        f"| `shard-convert imagefolder` (full decode check, tars, indexes, sha256) | "
        f"{r['convert_images_per_s']:.0f} [{lo_c:.0f}-{hi_c:.0f}] | {r['convert_mb_per_s']:.1f} |",
        "",
        f"Conversion runs at **{r['convert_over_decode']:.2f}x** the pure decode rate (goal: >= 0.7).",
    ])


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("build/convert-rate"), show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--workers", type=int, default=None, help="Default: the CPUs this process may use.")
def main(src: Path, workdir: Path, repeats: int, workers: int | None) -> None:
    """Measure shard-convert's images/s and MB/s against the pure decode rate of the same files."""
    result = measure(src, workdir, repeats, workers)
    click.echo(render_markdown(result))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "convert_rate.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
