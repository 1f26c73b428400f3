"""The data of a run: `--data` opened once (`open_data`: the shard folder(s), checked against the config),
and this rank's loaders built from it (`make_loaders`)."""

from __future__ import annotations

from dataclasses import asdict

from dalifeed.format import ManifestError
from dalifeed.pipelines import LoaderOptions, build_loader
from dalifeed.pipelines.dataset import Dataset, DatasetError, open_dataset

from .config import ConfigError, TrainConfig
from .distributed import Dist, log
from .synthetic import SyntheticLoader


def open_data(cfg: TrainConfig, dist: Dist) -> Dataset:
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
    per pipeline. DALI's checkpointing costs nothing measurable (docs; 575-625 images/s either way here) and
    lets any training step become a mid-epoch checkpoint: when --checkpoint-every says, and when a signal
    stops the run."""
    common = dict(batch_size=cfg.batch_size, rank=dist.rank, world_size=dist.world_size, seed=cfg.seed,
                  device=loader_device(cfg, dist), device_id=dist.device.index if dist.device.type == "cuda" else None,
                  num_threads=threads)
    train = LoaderOptions(cfg.train_split, train=True, checkpointing=True, **common)
    val = LoaderOptions(cfg.val_split, train=False, **common) if cfg.val_split is not None else None
    return train, val


def make_loaders(cfg: TrainConfig, dataset: Dataset, options: tuple[LoaderOptions, LoaderOptions | None]):
    """This rank's training loader and validation loader (None with --val-split none) over `dataset`; with
    --progressive-resize, the training loader's graph of each epoch is built for that epoch's size."""
    train_options, val_options = options
    schedule = cfg.resize_schedule()
    if schedule is not None:
        log(f"--progressive-resize {schedule}: {schedule.describe(cfg.epochs)}; validation at {cfg.val_size} px")
    train = build_loader(dataset, train_options, cfg.train_augment(),
                         image_size=schedule.size if schedule is not None else None)
    val = build_loader(dataset, val_options, cfg.val_augment()) if val_options is not None else None
    return (SyntheticLoader(train) if cfg.synthetic else train), val


def loader_record(options: tuple[LoaderOptions, LoaderOptions | None]) -> dict:
    """The loaders' options as config.json records them beside the run's config."""
    train, val = options
    return {"train": asdict(train), "val": asdict(val) if val is not None else None}
