"""The tars `shard-convert index` is raced on against DALI's `wds2idx` (docs/benchmarks.md).

    python examples/index_bench_data.py build/idxbench/tars [--count 10000] [--per-tar 1000]

ImageNet-like JPEGs (500x375 or 375x500 views of the photos `dalifeed.bench.sample_data` ships, with
sensor-like noise, quality 95: about 110 KB each) written as `jpg` + `cls` samples by webdataset's
`ShardWriter` (a pax header before every member), `--per-tar` samples a tar. 10,000 make 10 tars, 1.1 GB,
in a few minutes on 2 cores. Same seed, same files.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from dalifeed.bench.sample_data import _photo_sources, _random_view


def write_tars(out: Path, count: int, per_tar: int, seed: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    photos = [Image.fromarray(p) for _, p in sorted(_photo_sources().items())]
    rng = np.random.default_rng(seed)
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=per_tar, verbose=0) as sink:
        for i in range(count):
            label = i % len(photos)
            view = np.asarray(_random_view(photos[label], rng), dtype=np.float32)
            noisy = (view + rng.normal(0, 10, view.shape)).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(noisy).save(buf, format="JPEG", quality=95)
            sink.write({"__key__": f"{i:06d}", "jpg": buf.getvalue(), "cls": label})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the tars (created)")
    parser.add_argument("--count", type=int, default=10_000, help="samples in all (default: 10000)")
    parser.add_argument("--per-tar", type=int, default=1_000, help="samples a tar (default: 1000)")
    args = parser.parse_args()
    write_tars(args.out, args.count, args.per_tar)
    print(f"wrote {args.count} samples to {args.out}")


if __name__ == "__main__":
    main()
