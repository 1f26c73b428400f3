"""The data of a run: `--data` opened once (`open_data`: the shard folder(s), checked against the config),
this rank's loaders built from it (`make_loaders`); with several `--data A --data B --data-weights 3,1`,
what each brings to a batch (`mix_plan`, printed at start) and evaluation per dataset (`evaluate_each`;
dalifeed.pipelines.mixing mixes the batches); with `--synthetic`, the loader that stands in for the data
(`SyntheticLoader`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from dalifeed.format import ManifestError
from dalifeed.pipelines import LoaderOptions, make_loader
from dalifeed.pipelines.cursor import EpochCursor, FollowsCursor
from dalifeed.pipelines.dataset import DatasetError, ShardData, open_dataset
from dalifeed.pipelines.ranks import launcher_ranks

from .config import ConfigError, TrainConfig
from .distributed import Dist, log


def open_data(cfg: TrainConfig, dist: Dist) -> ShardData:
    """--data opened once, with everything the run's loaders would otherwise check again: shards of the kind
    --task needs, both splits present and holding samples (a typo in --val-split is refused before training,
    not trained through without evaluation), --batch-size (x --accum-steps) within every process's share.
    One line (ConfigError) for each."""
    if isinstance(cfg.data, list) and cfg.task != "classify":
        raise ConfigError("--task multilabel takes one --data (COCO shards cannot be mixed)")
    try:
        dataset = open_dataset(cfg.data, task=cfg.task, weights=cfg.data_weights, check=cfg.check_shards,
                               cache_dir=cfg.cache_dir, cache_limit=cfg.cache_limit)
    except (ManifestError, DatasetError) as e:  # each names the folder
        raise ConfigError(str(e)) from None
    for option, split in (("--train-split", cfg.train_split), ("--val-split", cfg.val_split)):
        if split is None:
            continue
        try:
            dataset.require_split(split, option)
        except DatasetError as e:
            hint = "; --val-split none trains without evaluation" if option == "--val-split" else ""
            raise ConfigError(f"{e}{hint}") from None
    try:
        dataset.check_batch_fits(cfg.train_split, cfg.batch_size * cfg.accum_steps, dist.world_size,
                                 what=f"--batch-size {cfg.batch_size} (x --accum-steps {cfg.accum_steps})")
    except DatasetError as e:
        raise ConfigError(str(e)) from None
    return dataset


def loader_device(cfg: TrainConfig, dist: Dist) -> str:
    """Where the pipeline decodes: on the training device, except that --device hybrid decodes on the CPU."""
    if dist.device.type != "cuda":
        return "cpu"
    return "hybrid" if cfg.device == "hybrid" else "gpu"


def loader_options(cfg: TrainConfig, dist: Dist, threads: int) -> tuple[LoaderOptions, LoaderOptions | None]:
    """This rank's training and validation (None with --val-split none) `LoaderOptions`, `threads` DALI threads
    per pipeline. DALI's checkpointing costs nothing measurable (docs) and lets any training step become a
    mid-epoch checkpoint: when --checkpoint-every says, and when a signal stops the run. The ranks are the
    loaders' own rule's (`ranks_from` says which source), which must be dali-train's (torchrun's). The training
    loader is told --epochs, so that it starts no pipeline past the last."""
    try:
        ranks = launcher_ranks()
    except ValueError as e:  # RANK without WORLD_SIZE, or not a number
        raise ConfigError(str(e)) from None
    if (ranks.rank, ranks.world_size) != (dist.rank, dist.world_size):  # srun without torchrun
        raise ConfigError(f"this process is rank {ranks.rank} of {ranks.world_size} ({ranks.source}) but dali-train's "
                          f"ranks are torchrun's RANK/WORLD_SIZE (rank {dist.rank} of {dist.world_size}): start it "
                          f"with torchrun, one agent per node (under Slurm: examples/slurm/train.sbatch)")
    common = dict(batch_size=cfg.batch_size, rank=dist.rank, world_size=dist.world_size, ranks_from=ranks.source,
                  seed=cfg.seed,
                  device=loader_device(cfg, dist), device_id=dist.device.index if dist.device.type == "cuda" else None,
                  num_threads=threads, channels_last=cfg.channels_last, hw_decoder_load=cfg.hw_decoder_load)
    train = LoaderOptions(cfg.train_split, train=True, checkpointing=True, lanes=cfg.lanes, epochs=cfg.epochs,
                          **common)
    val = LoaderOptions(cfg.val_split, train=False, **common) if cfg.val_split is not None else None
    return train, val


def make_loaders(cfg: TrainConfig, dataset: ShardData, options: tuple[LoaderOptions, LoaderOptions | None]):
    """This rank's training loader and validation loader (None with --val-split none) over `dataset`; with
    --progressive-resize, the training loader's graph of each epoch is built for that epoch's size."""
    train_options, val_options = options
    schedule = cfg.resize_schedule()
    if schedule is not None:
        log(f"--progressive-resize {schedule}: {schedule.describe(cfg.epochs)}; validation at {cfg.val_size} px")
        if (short := schedule.beyond(cfg.epochs)) is not None:
            log(f"warning: --progressive-resize {schedule}: {short} (--epochs {cfg.epochs}); the schedule is not "
                f"scaled to the run")
    train = make_loader(dataset, **asdict(train_options), augment=cfg.train_augment(),
                        size_schedule=schedule.size if schedule is not None else None)
    val = make_loader(dataset, **asdict(val_options), augment=cfg.val_augment()) if val_options is not None else None
    return (SyntheticLoader(train) if cfg.synthetic else train), val


def describe_lanes(loader) -> str | None:
    """The line that says in how many lanes (pipelines per rank: dalifeed/pipelines/lanes.py) the training
    loader reads, and with how many DALI threads each; None for a loader without lanes (several datasets
    mixed) or with one."""
    options = getattr(loader, "options", None)
    lanes = getattr(options, "lanes", None)
    if not lanes or lanes == 1:
        return None
    return (f"training loader: {lanes} lanes of {max(1, options.num_threads // lanes)} DALI thread(s) each "
            f"(--lanes; each reads its part of this rank's shard)")


def loader_record(options: tuple[LoaderOptions, LoaderOptions | None]) -> dict:
    """The loaders' options as config.json records them beside the run's config."""
    train, val = options
    return {"train": asdict(train), "val": asdict(val) if val is not None else None}


# ----------------------------------------------------------------------------------------------------
# several datasets mixed


def mix_plan(cfg, datasets, world_size: int) -> list[dict]:
    """What each --data brings to training, as the mixed loader will draw it: its weight, its samples in every
    batch of a process (`ShardData.shares`), its train samples and how many passes over them an epoch makes (an
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


# ----------------------------------------------------------------------------------------------------
# --synthetic: data that costs nothing, to measure what loading costs


class SyntheticLoader(FollowsCursor):
    """Stands in for the training loader: one real batch of it, kept on the device, handed out `len(loader)`
    times an epoch. What the trainer reaches on it is the speed of model and optimiser alone (the
    ceiling); a run on the real loader at the same options shows how close the data path comes to it.
    Counts its place as every loader does (`EpochCursor`: epoch, samples consumed by all ranks)."""

    last_samples: list[str] = []  # no data is read: --log-samples logs none

    def __init__(self, loader):
        self._loader, self._length = loader, len(loader)
        self._batch = None
        self.cursor = EpochCursor(loader.cursor.global_batch)

    def __len__(self) -> int:
        return self._length

    def state_dict(self) -> dict:
        return {**self.cursor.state_dict(), "dali": None}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)
        self._restore = state  # the next iteration continues at the cursor

    def _first_batch(self):
        images, labels = next(iter(self._loader))
        self._loader = None  # its pipeline (and the device memory it holds) is not needed again
        # DALI reuses its output buffers: keep copies, in the same memory format
        return images.clone(), labels.clone()

    def __iter__(self):
        if self._batch is None:
            self._batch = self._first_batch()
        restore, self._restore = self._restore, None
        if restore is None:
            self.cursor.start(self.cursor.epoch)
        while self.cursor.batches_done < self._length:
            self.cursor.advance()
            yield self._batch
        self.cursor.finish()
