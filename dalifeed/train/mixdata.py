"""dali-train over several shard folders (`--data A --data B --data-weights 3,1`): the `Dataset` of their
union (dalifeed.pipelines.dataset) stands for the manifest, and evaluation runs on each dataset apart
(dalifeed.pipelines.mixing)."""

from __future__ import annotations

from pathlib import Path


def mix_plan(cfg, datasets, world_size: int) -> list[dict]:
    """What each --data brings to training, as the mixed loader will draw it: its weight, its samples in every
    batch of a process (`Dataset.shares`), its train samples and how many passes over them an epoch makes (an
    epoch is the union's samples, in batches of --batch-size on every process)."""
    weights = cfg.data_weights or [1.0] * len(cfg.data)
    shares = datasets.shares(cfg.batch_size)
    samples = [source.manifest.num_samples(cfg.train_split) for source in datasets.sources]
    batches = sum(samples) // world_size // cfg.batch_size  # MixedLoader's epoch
    return [{"data": str(location), "name": name, "weight": weight, "per_batch": share, "train_samples": n,
             "passes_per_epoch": round(share * batches * world_size / n, 3) if n else 0.0}
            for location, name, weight, share, n in zip(cfg.data, dataset_names(cfg.data), weights, shares, samples)]


def describe_plan(plan: list[dict], batch_size: int) -> str:
    return (f"mixing {len(plan)} datasets, in every batch of {batch_size} (per process): "
            + "; ".join(f"{p['name']} {p['per_batch']} ({p['per_batch'] / batch_size:.0%}, weight {p['weight']:g}, "
                        f"{p['train_samples']} train samples, {passes(p['passes_per_epoch'])} an epoch)" for p in plan))


def passes(count: float) -> str:
    """How many times an epoch reads a dataset's train split: "1 pass", "0.9 passes"."""
    return f"{count:g} pass" + ("" if count == 1 else "es")


def dataset_names(locations: list[str]) -> list[str]:
    """Short, distinct names for the metrics of each dataset: the folder's name, or data0, data1, ..."""
    names = [Path(str(location).rstrip("/")).name or f"data{i}" for i, location in enumerate(locations)]
    return names if len(set(names)) == len(names) else [f"data{i}" for i in range(len(locations))]


def evaluate_each(score, loader) -> dict:
    """`score(loader) -> {"val_loss", "top1", ..., "val_samples"}` over each dataset of a mixed validation
    loader (`loader.per_dataset`), reported as `NAME/top1` ..., and over all of them together (the
    sample-weighted means, what one loader over the union would give) under the usual names."""
    parts = dict(zip(dataset_names(list(loader.per_dataset)), (score(x) for x in loader.per_dataset.values())))
    total = sum(r["val_samples"] for r in parts.values())
    record = {key: sum(r[key] * r["val_samples"] for r in parts.values()) / total
              for key in next(iter(parts.values())) if key != "val_samples"}
    record["val_samples"] = total
    for name, result in parts.items():
        record.update({f"{name}/{key}": value for key, value in result.items()})
    return record
