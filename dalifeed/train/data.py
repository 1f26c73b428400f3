"""The data of a run: the shard folder(s) `--data` names, opened and checked against the config, and the
loaders that read them for this rank."""

from __future__ import annotations

from dalifeed.format import ManifestError, ShardManifest
from dalifeed.pipelines import make_loader
from dalifeed.shardfolder import open_shard_folder

from .config import ConfigError, TrainConfig
from .distributed import Dist
from .mixdata import open_datasets
from .synthetic import SyntheticLoader


def load_manifest(cfg: TrainConfig) -> ShardManifest:
    if isinstance(cfg.data, list):  # several datasets: their union stands for the manifest
        datasets = open_datasets(cfg)
        check_splits(cfg, datasets)
        return datasets
    try:
        manifest = open_shard_folder(cfg.data)  # a folder, or s3://bucket/prefix
    except ManifestError as e:
        raise ConfigError(str(e)) from None
    if cfg.task == "multilabel" and manifest.kind != "coco":
        raise ConfigError(f"--task multilabel needs COCO shards (shard-convert coco); {cfg.data} holds {manifest.kind}")
    if cfg.task == "classify" and manifest.kind == "coco":  # their samples hold label lists, not one class
        raise ConfigError(f"--data {cfg.data} holds COCO shards: use --task multilabel (--task classify needs "
                          f"ImageFolder shards)")
    check_splits(cfg, manifest)
    return manifest


def check_splits(cfg: TrainConfig, manifest: ShardManifest) -> None:
    """Both splits exist and hold samples: a typo in a split name (--val-split validation) is refused before
    training, not trained through without evaluation. No evaluation is asked for with --val-split none."""
    for option, split in (("--train-split", cfg.train_split), ("--val-split", cfg.val_split)):
        if split is None:
            continue
        hint = "; --val-split none trains without evaluation" if option == "--val-split" else ""
        if split not in manifest.splits:
            raise ConfigError(f"{option} {split}: --data {cfg.data} has no such split (has: "
                              f"{', '.join(manifest.splits)}){hint}")
        if not manifest.num_samples(split):
            raise ConfigError(f"{option} {split}: that split of --data {cfg.data} holds no samples{hint}")


def check_batch_fits(cfg: TrainConfig, dist: Dist, manifest: ShardManifest) -> None:
    per_rank = manifest.num_samples(cfg.train_split) // dist.world_size
    if per_rank < cfg.batch_size * cfg.accum_steps:
        raise ConfigError(f"--batch-size {cfg.batch_size} (x --accum-steps {cfg.accum_steps}) is more than the "
                          f"{per_rank} training samples each of {dist.world_size} process(es) gets "
                          f"({manifest.num_samples(cfg.train_split)} in {cfg.data}); lower it")


def loader_device(cfg: TrainConfig, dist: Dist) -> str:
    """Where the pipeline decodes: on the training device, except that --device hybrid decodes on the CPU."""
    if dist.device.type != "cuda":
        return "cpu"
    return "hybrid" if cfg.device == "hybrid" else "gpu"


def make_loaders(cfg: TrainConfig, dist: Dist, threads: int) -> tuple[object, object | None]:
    """This rank's training loader and validation loader (None with --val-split none), `threads` DALI threads
    per pipeline."""
    common = dict(rank=dist.rank, world_size=dist.world_size, device=loader_device(cfg, dist),
                  channels_last=cfg.channels_last, num_threads=threads,
                  device_id=dist.device.index if dist.device.type == "cuda" else None, check=cfg.check_shards,
                  multilabel=cfg.task == "multilabel", seed=cfg.seed, cache_dir=cfg.cache_dir,
                  cache_limit=cfg.cache_limit)
    if isinstance(cfg.data, list):  # several datasets mixed: their shares of a batch
        common["weights"] = cfg.data_weights
    # DALI's checkpointing costs nothing measurable (docs; 575-625 images/s either way here) and lets any
    # step become a mid-epoch checkpoint: when --checkpoint-every says, and when a signal stops the run
    train = make_loader(cfg.data, cfg.train_split, cfg.batch_size, augment=cfg.train_augment(), checkpointing=True,
                        train=True, **common)
    # validation's size and decoder share; training's are in its AugmentConfig
    val = make_loader(cfg.data, cfg.val_split, cfg.batch_size, train=False, image_size=cfg.image_size,
                      hw_decoder_load=cfg.hw_decoder_load, **common) \
        if cfg.val_split is not None else None
    return (SyntheticLoader(train) if cfg.synthetic else train), val
