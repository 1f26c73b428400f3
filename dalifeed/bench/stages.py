"""Where the DALI training pipeline spends its time: the same graph cut after each stage, same threads.

Each rate is a ceiling for everything after it, so the table says what limits the full pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path

from nvidia.dali import fn, pipeline_def

from dalifeed.format import ShardManifest
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.pipelines.graphs import decode_random_crop, normalize, read_shards, resize_square
from dalifeed.shardfolder import check_split, open_shard_folder

STAGES = ("read", "decode (ROI)", "+ resize", "+ flip, normalise")


@pipeline_def(enable_conditionals=False)
def cut_pipeline(paths, index_paths, cfg: AugmentConfig, device: str, stage: int):
    """The training graph (graphs.train_augment) cut after STAGES[stage]."""
    data, _ = read_shards(paths, index_paths, shard_id=0, num_shards=1, shuffle=True, initial_fill=256)
    if stage >= 1:
        data = decode_random_crop(data, cfg, device)
    if stage >= 2:
        data = resize_square(data, cfg)
    if stage >= 3:
        data = normalize(data, cfg, mirror=fn.random.coin_flip(probability=0.5))
    return data


def stage_rates(shards: Path | str | ShardManifest, split: str = "train", *, batch_size: int = 64, threads: int = 2,
                image_size: int = 224, batches: int = 30, device: str = "cpu") -> dict[str, float]:
    """Throughput of the pipeline ending after each stage (DALI alone: no PyTorch iterator, no copy out).
    `shards` may be s3://bucket/prefix, or its manifest already opened."""
    manifest = open_shard_folder(shards)
    check_split(manifest, split)  # in a store: fetches the indexes into the cache
    paths = [manifest.shard_location(s) for s in manifest.split_info(split).shards]
    indexes = [str(p) for p in manifest.index_paths(split)]
    cfg = AugmentConfig(image_size=image_size)
    rates = {}
    for stage, name in enumerate(STAGES):
        pipe = cut_pipeline(paths, indexes, cfg, device, stage, batch_size=batch_size, num_threads=threads,
                            device_id=0 if device == "gpu" else None, seed=0)
        pipe.build()
        for _ in range(3):
            pipe.run()
        start = time.perf_counter()
        for _ in range(batches):
            pipe.run()
        rates[name] = batches * batch_size / (time.perf_counter() - start)
        del pipe
    return rates


def render_markdown(rates: dict[str, float], baseline: float | None) -> str:
    lines = ["| DALI pipeline cut after | images/s | x baseline |", "|---|---|---|"]
    for name, rate in rates.items():
        ratio = f"{rate / baseline:.2f}" if baseline else "-"
        lines.append(f"| {name} | {rate:.0f} | {ratio} |")
    return "\n".join(lines)
