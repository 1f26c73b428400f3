"""Several shard folders at once in fixed proportions: `make_loader([A, B], "train", weights=[3, 1], ...)`.

DALI has no operator for it (users are told to write an ExternalSource), so each dataset keeps its own
pipeline (a `DaliLoader` of its own, with its own label source) and this module interleaves their batches
in torch. The contract, extending `dalifeed.pipelines.loader`'s:

- **Batches**: every batch of `batch_size` holds `shares[i]` samples of dataset i, the weights rounded to
  whole samples by largest remainder (weights 3,1 and batch 256: 192 + 64). The realised proportion is
  `shares[i] / batch_size`, within `1 / batch_size` of the weight's; a weight too small to give a dataset
  one sample per batch is refused. Dataset i's pipeline runs with batch `shares[i]`.
- **Epoch**: defined by the samples drawn, `sum of the datasets' train samples` (as if they were one
  dataset), so every rank yields `len(loader) = floor(total / world / batch_size)` batches, the same on
  every rank. A dataset whose share needs more samples than it holds repeats (its own loader runs several
  of its epochs); one that needs fewer is cut short, its order moving on with the next epoch.
- **Order**: in epoch e dataset i's loader runs its own epochs `e * R_i, e * R_i + 1, ...`, with `R_i` the
  most it can need per epoch: the order is a function of `(seed, epoch)` only, and `set_epoch` jumps.
- **Classes**: the union of the datasets' class names, sorted as ImageFolder sorts folders; each dataset's
  own indices are mapped to it (`remaps`) on the batch's device.
- **Resume**: `state_dict()` between two batches holds the epoch, the batches done and every dataset
  loader's own state (DALI checkpoints: `checkpointing=True`); a fresh loader given it yields exactly the
  rest of the epoch.
- **Evaluation** (`train=False`): every sample of every dataset once, dataset after dataset, labels mapped;
  `per_dataset` holds one loader per dataset so that each is evaluated and reported apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dalifeed.format import trains
from dalifeed.s3 import is_s3_url
from dalifeed.shardfolder import open_shard_folder


class MixError(ValueError):
    """Datasets or weights that cannot be mixed (a usage error)."""


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


@dataclass
class MixedDatasets:
    """What a trainer needs to know of the datasets mixed, answered as a `ShardManifest` answers it for one:
    the classes of the union (and each dataset's map into it), the splits all of them have, sample counts."""

    locations: list[str]
    manifests: list
    classes: list[str]
    remaps: list[list[int]]
    kind: str = "mixed"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def splits(self) -> dict:
        """The splits every dataset has (name -> the first dataset's; only the names are meant)."""
        names = set.intersection(*(set(m.splits) for m in self.manifests))
        return {name: self.manifests[0].splits[name] for name in self.manifests[0].splits if name in names}

    def num_samples(self, split: str) -> int:
        return sum(m.num_samples(split) for m in self.manifests)


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


def describe_datasets(locations: list[str]) -> MixedDatasets:
    """Open every dataset's manifest and build the union of their classes (refusing repeats and kinds it
    cannot mix)."""
    refuse_repeats(locations)
    manifests = [open_shard_folder(location) for location in locations]
    for location, manifest in zip(locations, manifests):
        if manifest.kind == "coco":
            raise MixError(f"{location}: COCO shards cannot be mixed (one class label per sample is needed)")
    classes, remaps = union_classes([m.classes for m in manifests])
    return MixedDatasets([str(x) for x in locations], manifests, classes, remaps)


class RemappedLoader:
    """One dataset's loader whose labels are mapped into the union's classes (evaluation of one dataset)."""

    def __init__(self, loader, remap: list[int]):
        self.loader, self.remap = loader, torch.tensor(remap, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def num_samples(self) -> int:
        return self.loader.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        remap = None
        for images, labels in self.loader:
            remap = self.remap.to(labels.device) if remap is None else remap
            yield images, remap[labels]


class MixedLoader:
    """Training batches drawn from several datasets in fixed proportions (module docstring)."""

    def __init__(self, loaders: list, shares: list[int], remaps: list[list[int]], total_samples: int,
                 batch_size: int, world_size: int, datasets: MixedDatasets):
        self.loaders, self.shares, self.batch_size, self.datasets = loaders, shares, batch_size, datasets
        self.remaps = [torch.tensor(r, dtype=torch.int64) for r in remaps]
        self.total_samples, self.world_size = total_samples, world_size
        self.batches = total_samples // world_size // batch_size
        if self.batches < 1:
            raise MixError(f"{total_samples} samples in all: too few for batch {batch_size} on each of "
                           f"{world_size} ranks")
        # the most of its own epochs dataset i can need in one mixed epoch
        self.reserved = [-(-self.batches // len(loader)) for loader in loaders]
        self.epoch = 0
        self._batches_done = 0
        self._restore: dict | None = None

    def __len__(self) -> int:
        return self.batches

    @property
    def num_samples(self) -> int:
        return self.batches * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        """The epoch, the batches handed out and, between two batches of an epoch, every dataset loader's
        state (needs `checkpointing=True`)."""
        if self._batches_done == 0:
            return {"epoch": self.epoch, "batches_done": 0, "datasets": None}
        return {"epoch": self.epoch, "batches_done": self._batches_done,
                "datasets": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        self._restore = state

    def _stream(self, i: int):
        loader = self.loaders[i]
        while True:
            yield from loader  # one of its own epochs a pass; the loader moves to its next epoch itself

    def __iter__(self):
        restore, self._restore = self._restore, None
        if restore is not None:
            self.epoch, self._batches_done = restore["epoch"], restore["batches_done"]
        if restore is not None and restore["datasets"] is not None:
            for loader, state in zip(self.loaders, restore["datasets"]):
                loader.load_state_dict(state)
        else:
            self._batches_done = 0
            for loader, reserved in zip(self.loaders, self.reserved):
                loader.set_epoch(self.epoch * reserved)
        streams = [self._stream(i) for i in range(len(self.loaders))]
        remaps = None
        while self._batches_done < self.batches:
            parts = [next(stream) for stream in streams]
            if remaps is None:
                remaps = [r.to(parts[0][1].device) for r in self.remaps]
            images = torch.cat([p[0] for p in parts])
            labels = torch.cat([remap[p[1]] for remap, p in zip(remaps, parts)])
            self._batches_done += 1
            yield images, labels
        for stream in streams:
            stream.close()
        self._batches_done = 0
        self.epoch += 1


class ConcatLoader:
    """Evaluation over several datasets: each one's loader in turn, every sample once, labels mapped;
    `per_dataset` (location -> loader) to evaluate and report each apart."""

    def __init__(self, per_dataset: dict[str, RemappedLoader]):
        self.per_dataset = per_dataset

    def __len__(self) -> int:
        return sum(len(loader) for loader in self.per_dataset.values())

    @property
    def num_samples(self) -> int:
        return sum(loader.num_samples for loader in self.per_dataset.values())

    def set_epoch(self, epoch: int) -> None:
        for loader in self.per_dataset.values():
            loader.set_epoch(epoch)

    def __iter__(self):
        for loader in self.per_dataset.values():
            yield from loader


def make_mixed_loader(locations: list, split: str, batch_size: int, *, weights: list[float] | None,
                      train: bool | None, make_one, **loader_args):
    """`make_loader` over several shard folders (see the module docstring); `make_one(location, split,
    batch_size, train=..., **loader_args)` makes one dataset's loader (`make_loader` itself)."""
    if not locations:
        raise MixError("no datasets given")
    weights = [1.0] * len(locations) if weights is None else [float(w) for w in weights]
    if len(weights) != len(locations):
        raise MixError(f"{len(weights)} weights for {len(locations)} datasets")
    if loader_args.get("multilabel"):
        raise MixError("multi-label (COCO) datasets cannot be mixed")
    datasets = describe_datasets(locations)
    train = trains(split, train)
    if not train:
        return ConcatLoader({str(location): RemappedLoader(make_one(location, split, batch_size, train=False,
                                                                    **loader_args), remap)
                             for location, remap in zip(locations, datasets.remaps)})
    shares = batch_shares(weights, batch_size)
    for location, share, weight in zip(locations, shares, weights):
        if share == 0:
            raise MixError(f"{location}: weight {weight} gives it no sample of a batch of {batch_size}: "
                           f"raise its weight or the batch size")
    loaders = []
    for location, share in zip(locations, shares):
        try:
            loaders.append(make_one(location, split, share, train=True, **loader_args))
        except ValueError as e:  # e.g. fewer samples than its share of a batch on each rank
            raise MixError(f"{location}: {e}") from None
    total = sum(loader.total_samples for loader in loaders)
    return MixedLoader(loaders, shares, datasets.remaps, total, batch_size, loader_args.get("world_size", 1), datasets)
