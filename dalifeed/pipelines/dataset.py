"""The data a command reads, opened once: `open_dataset(data, task=..., splits=..., ...)`.

One call opens the shard folder(s) (local or s3://, one or several mixed with weights), checks what every
command would otherwise check again (the kind of shards the task needs, that the splits exist and hold
samples, that a training batch fits every rank) and returns a `ShardData`. The loader factories
(`make_loader`, `make_detection_loader`), dali-train and dali-bench take it; nothing opens a
manifest twice.

A `ShardData` is one or several `Source`s: a shard folder's location, its manifest and, for a folder in a
store, the node's shard cache its tars are fetched into before DALI reads them (dalifeed/pipelines/shardcache.py), a
constructor argument: the loaders read where the dataset says. Several sources are mixed in proportions
(`weights`; dalifeed/pipelines/mixing.py says how) over the union of their classes, which `remap` maps each
source's own class indices into.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dalifeed.format import ShardManifest
from dalifeed.pipelines.shardcache import CacheConfig, cache_config
from dalifeed.s3 import is_s3_url
from dalifeed.shardfolder import check_split, open_shard_folder

from .checks import VERIFY_HINT, ShardDataError

TASKS = ("classify", "multilabel", "detection")
SHARD_CHECKS = ("size", "sha256")


class DatasetError(ValueError):
    """Data that cannot serve what was asked of it (no such split, the wrong kind of shards, a batch larger
    than a rank's share): a usage error, one line."""


class MixError(DatasetError):
    """Datasets or weights that cannot be mixed (a usage error)."""


@dataclass
class Source:
    """One shard folder: where it is, its manifest, the node's shard cache for a folder in a store (None: DALI
    reads the tars where they are; each loader opens its own `ShardCache` with it, whose pins are that
    loader's epoch), and its class indices in the dataset's classes (None: the same)."""

    location: str
    manifest: ShardManifest
    cache: CacheConfig | None = None
    remap: list[int] | None = None


@dataclass
class ShardData:
    """Shard folder(s) opened and checked, as `open_dataset` returns them; `make_loader`,
    `make_detection_loader`, dali-train and dali-bench take one instead of a path, so nothing opens a manifest
    twice. Answers what a `ShardManifest` answers for one folder (kind, classes, splits, sample counts) for
    the union of several.

    Attributes:
        sources: The folders, one record each: `location` (as given), `manifest` (its `ShardManifest`),
            `cache` (the node's shard cache for a folder in a store, else None) and `remap` (its class indices
            in `classes`; None for one folder).
        classes: The class names, sorted; mixed, the union of the folders' classes.
        task: What the samples are read as, which decides the graph and targets the loaders build:
            `"classify"`, `"multilabel"` or `"detection"`. Default `"classify"`.
        weights: Each folder's share of every batch, as given (not normalised); None for one folder.
            Default None.
        check: What is compared with the manifests before a split is first read: `"size"` (sizes and DALI
            indexes) or `"sha256"` (every byte's hash too). Default `"size"`.
    """

    sources: list[Source]
    classes: list[str]
    task: str = "classify"
    weights: list[float] | None = None
    check: str = "size"
    _checked: set = field(default_factory=set, init=False, repr=False)

    @property
    def mixed(self) -> bool:
        """Several folders are mixed."""
        return len(self.sources) > 1

    @property
    def location(self) -> str | list[str]:
        """What was opened, as the user gave it: one folder's location, or the list."""
        return [s.location for s in self.sources] if self.mixed else self.sources[0].location

    @property
    def manifest(self) -> ShardManifest:
        """The one folder's manifest (a mixed dataset has several: `sources`)."""
        if self.mixed:
            raise DatasetError(f"{len(self.sources)} shard folders are mixed: each has its own manifest (sources)")
        return self.sources[0].manifest

    @property
    def kind(self) -> str:
        """What the shards were made from: `"imagefolder"`, `"coco"`, ... as the manifest says; `"mixed"`."""
        return "mixed" if self.mixed else self.sources[0].manifest.kind

    @property
    def num_classes(self) -> int:
        """The number of classes (of the union, mixed)."""
        return len(self.classes)

    @property
    def splits(self) -> dict:
        """The splits every folder has (name -> the first folder's; only the names are meant when mixed)."""
        first = self.sources[0].manifest.splits
        names = set.intersection(*(set(s.manifest.splits) for s in self.sources))
        return {name: first[name] for name in first if name in names}

    def num_samples(self, split: str) -> int:
        """The samples of `split`, every folder's together.

        Args:
            split: A split every folder has.
        """
        return sum(s.manifest.num_samples(split) for s in self.sources)

    def shares(self, batch_size: int) -> list[int]:
        """Samples of each folder in a batch: the weights' shares, rounded so that they add up to the batch.

        Args:
            batch_size: Samples in the batch.

        Returns:
            One count per folder, in the order of `sources` (one folder: `[batch_size]`).
        """
        return batch_shares(self.weights or [1.0] * len(self.sources), batch_size)

    # -- what every command checks, once ---------------------------------------------------------
    def require_split(self, split: str, option: str = "split") -> None:
        """Check that `split` exists in every folder and holds samples.

        Args:
            split: The split's name.
            option: How the user named the split, for the error (e.g. `"--val-split"`). Default `"split"`.

        Raises:
            DatasetError: No such split, or it holds no samples.
        """
        if split not in self.splits:
            raise DatasetError(f"{option} {split}: {self.described} has no such split (has: "
                               f"{', '.join(self.splits) or 'none'})")
        if not self.num_samples(split):
            raise DatasetError(f"{option} {split}: that split of {self.described} holds no samples")

    def check_batch_fits(self, split: str, batch_size: int, world_size: int = 1, what: str | None = None) -> None:
        """Check that every rank gets at least one full batch of `split` (training drops partial batches);
        mixed, every folder its share of one.

        Args:
            split: The split's name.
            batch_size: Samples per batch and rank.
            world_size: The number of ranks sharing the split. Default 1.
            what: How the error names the batch; None: `"batch BATCH_SIZE"`. Default None.

        Raises:
            DatasetError: A rank's part of a folder holds fewer samples than its share of a batch.
        """
        what = what or f"batch {batch_size}"
        for source, share in zip(self.sources, self.shares(batch_size)):
            samples = source.manifest.num_samples(split)
            if samples // world_size < share:
                part = f"its share {share} of {what}" if self.mixed else what
                raise DatasetError(f"{source.location}: {part} is more than the {samples // world_size} samples of "
                                   f"split {split!r} each of {world_size} process(es) gets ({samples} in all): "
                                   f"lower it")

    def check_files(self, split: str) -> None:
        """Check that the files of `split` agree with their manifests (`check`: sizes, or hashes too); each
        split is checked once.

        Args:
            split: The split's name.

        Raises:
            ShardDataError: A shard or index is missing or differs from its manifest (the first named).
        """
        if split in self._checked:
            return
        for source in self.sources:
            problems = check_split(source.manifest, split, sha256=self.check == "sha256")  # on disk, or HEADs
            if problems:
                more = f" (and {len(problems) - 1} more: see shard-convert verify)" if len(problems) > 1 else ""
                raise ShardDataError(f"{problems[0]}{more}; {VERIFY_HINT.format(root=source.manifest.location)}")
        self._checked.add(split)

    @property
    def described(self) -> str:
        """The folders' locations joined by " + ", for messages."""
        return " + ".join(s.location for s in self.sources)

    def contents(self, splits: list[str]) -> list[dict]:
        """What each folder holds of `splits`, as a checkpoint records it, for a resume to compare with what
        the folder holds then.

        Args:
            splits: The split names; a folder's splits not among them are left out.

        Returns:
            One dict per folder: its `location` and, per split, every shard's `[path, sha256, index sha256]`.
        """
        return [{"location": s.location,
                 "splits": {split: [[shard.path, shard.sha256, shard.index_sha256]
                                    for shard in s.manifest.split_info(split).shards]
                            for split in splits if split in s.manifest.splits}}
                for s in self.sources]


def open_dataset(data: str | os.PathLike | list, *, task: str = "classify", splits: tuple[str, ...] = (),
                 weights: list[float] | None = None, check: str = "size",
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None) -> ShardData:
    """Open one shard folder, or several mixed into every batch, and check them for a task, once.

    The result is what `make_loader` and `make_detection_loader` take instead of a path: the manifests are
    read and checked here, not again by each loader.

    Args:
        data: A shard folder (a local path or `s3://bucket/prefix`), or a list of them to mix.
        task: What the samples are read as: `"classify"` (ImageFolder or TFRecord shards, one class per
            sample), `"multilabel"` or `"detection"` (COCO shards). Default `"classify"`.
        splits: Splits that must exist in every folder and hold samples. Default none.
        weights: With a list `data`: each folder's share of every batch (positive numbers, normalised);
            None: equal shares. Default None.
        check: What the loaders compare with the manifests before first reading a split: `"size"` (sizes and
            DALI indexes) or `"sha256"` (every byte's hash too: a full read). Default `"size"`.
        cache_dir: `s3://` folders only: the node's shard cache folder, shared by its ranks, where each tar
            is fetched whole before DALI reads it; None: shards/ in `$DALIFEED_CACHE` or ~/.cache/dalifeed.
            Default None.
        cache_limit: `s3://` folders only: the shard cache's bound, in bytes or as a size string (`"20GB"` is
            20 x `10^9` bytes, `"20GiB"` 20 x `2^30`); tars read earliest are evicted first. None: 90% of the
            free space. Default None.

    Returns:
        The folders opened and checked.

    Raises:
        ManifestError: A location holds no finished shard folder.
        DatasetError: A bad argument, shards of the wrong kind for `task`, or a split missing or empty (a
            `ValueError`; `MixError`, a subclass, for folders or weights that cannot be mixed).

    Example:
        ```python
        from dalifeed.pipelines import make_loader, open_dataset

        data = open_dataset(["/data/imagenet-shards", "s3://bucket/extra"], weights=[3, 1], splits=("train",))
        loader = make_loader(data, "train", 256)
        ```
    """
    if task not in TASKS:
        raise DatasetError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if check not in SHARD_CHECKS:
        raise DatasetError(f"check must be one of {', '.join(SHARD_CHECKS)}, got {check!r}")
    locations = [str(x) for x in data] if isinstance(data, (list, tuple)) else [str(data)]
    if not locations:
        raise MixError("no datasets given")
    if weights is not None and not isinstance(data, (list, tuple)):
        raise MixError(f"weights={weights} mixes a list of shard folders; {data} is one")
    if len(locations) > 1 or weights is not None:
        weights = [1.0] * len(locations) if weights is None else [float(w) for w in weights]
        if len(weights) != len(locations):
            raise MixError(f"{len(weights)} weights for {len(locations)} datasets")
        batch_shares(weights, 1)  # refuses weights that are not positive numbers
        refuse_repeats(locations)
    cache = cache_config(cache_dir, cache_limit, sha256=check == "sha256")  # a bad size fails before any GET
    manifests = [open_shard_folder(location) for location in locations]
    for location, manifest in zip(locations, manifests):
        refuse_kind(location, manifest, task, mixed=len(locations) > 1)
    classes, remaps = union_classes([m.classes for m in manifests])
    sources = [Source(location, manifest, cache if manifest.url else None, None if len(locations) == 1 else remap)
               for location, manifest, remap in zip(locations, manifests, remaps)]
    dataset = ShardData(sources, classes if len(locations) > 1 else manifests[0].classes, task, weights, check)
    for split in splits:
        dataset.require_split(split)
    return dataset


def refuse_kind(location: str, manifest: ShardManifest, task: str, mixed: bool) -> None:
    """The shards `task` needs: one class per sample (ImageFolder) to classify, COCO's labels and boxes for
    multilabel and detection; mixing needs one class per sample."""
    if mixed and manifest.kind == "coco":
        raise MixError(f"{location}: COCO shards cannot be mixed (one class label per sample is needed)")
    if task == "classify" and manifest.kind == "coco":  # DALI would fail on the missing one-class label member
        raise DatasetError(f"{location} holds COCO shards (label lists, not one class a sample): read them as "
                           f"multi-label targets (dali-train --task multilabel, open_dataset(path, task='multilabel')) "
                           f"or for detection (dali-bench --task detection, make_detection_loader)")
    if task in ("multilabel", "detection") and manifest.kind != "coco":
        raise DatasetError(f"{location} holds {manifest.kind} shards: {task} needs COCO shards (shard-convert coco)")


def batch_shares(weights: list[float], batch_size: int) -> list[int]:
    """Samples of each dataset in a batch: `weights` (normalised) times `batch_size`, rounded by largest
    remainder so that they add up to `batch_size`."""
    if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise MixError(f"weights must be positive numbers, got {weights}")
    total = sum(weights)
    exact = [w / total * batch_size for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[:batch_size - sum(shares)]:
        shares[i] += 1
    return shares


def union_classes(class_lists: list[list[str]]) -> tuple[list[str], list[list[int]]]:
    """The sorted union of the datasets' class names, and per dataset the union index of each of its own."""
    classes = sorted({name for names in class_lists for name in names})
    index = {name: i for i, name in enumerate(classes)}
    return classes, [[index[name] for name in names] for names in class_lists]


def same_place(location) -> str:
    """What two locations of one dataset have in common: the resolved path of a folder (symlinks and `./`
    followed), an s3:// URL without its trailing slashes."""
    text = str(location)
    return text.rstrip("/") if is_s3_url(text) else str(Path(text).resolve())


def refuse_repeats(locations: list) -> None:
    """The same dataset twice would double its share of every batch without a word: --data-weights says that."""
    seen: dict[str, str] = {}
    for location in locations:
        place = same_place(location)
        if place in seen:
            raise MixError(f"the same dataset is given twice ({seen[place]} and {location}): give it once and "
                           f"weight it with --data-weights (make_loader: weights=)")
        seen[place] = str(location)


__all__ = ["ShardData", "DatasetError", "MixError", "Source", "open_dataset"]
