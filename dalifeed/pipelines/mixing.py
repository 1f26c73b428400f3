"""Several shard folders at once in fixed proportions: `make_loader(open_dataset([A, B], weights=[3, 1]), ...)`.

DALI has no operator for it (users are told to write an ExternalSource), so each dataset keeps its own
pipeline (a `DaliLoader` of its own, with its own label source) and this module interleaves their batches
in torch. The contract extends `dalifeed.pipelines.loader`'s (in full: docs/pipelines.md):

- every batch holds `shares[i]` samples of dataset i, the weights rounded to whole samples;
- an epoch is the datasets' training samples summed, the same `len(loader)` on every rank; a dataset repeats
  or is cut short to give its share, in an order that is a function of `(seed, epoch)` only;
- the classes are the union of the datasets' class names, each dataset's own indices mapped to it;
- `state_dict()` resumes mid-epoch exactly; evaluation reads every dataset once, one after the other;
- the training pipelines share the rank's DALI thread budget in proportion to their shares (`share_threads`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .cursor import EpochCursor, FollowsCursor
from .dataset import MixError, ShardData
from .elastic import batches_left

__all__ = ["ConcatLoader", "MixError", "MixedLoader", "RemappedLoader", "mixed_loader", "share_threads"]


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


class MixedLoader(FollowsCursor):
    """Training batches drawn from several shard folders in fixed proportions: what `make_loader` returns for
    a training split of mixed data (`open_dataset([A, B], weights=[3, 1])`).

    Every batch holds each folder's share of samples (the weights rounded to whole samples), labelled in
    the union of the folders' classes. An epoch is the folders' training samples summed, the same
    `len(loader)` on every rank; a folder repeats or is cut short to give its share, in an order that
    depends on `(seed, epoch)` alone. `set_epoch`, `state_dict` and `load_state_dict` work as
    `DaliLoader`'s; the folders' pipelines share the rank's DALI threads in proportion to their shares.

    Args:
        loaders: One loader per folder, each reading its share of every batch.
        shares: Samples of each folder in a batch; they add up to `batch_size`.
        remaps: Per folder, the index in the union's classes of each of its own classes.
        total_samples: The epoch's samples across all ranks (the folders' training samples summed).
        batch_size: Samples per batch on each rank.
        world_size: The number of ranks reading together.
        dataset: The data the loaders read (its `classes` are the union's); None when not known.
            Default None.

    Attributes:
        last_samples: The last batch's samples as `FOLDER/SHARD:POSITION` (FOLDER the folder's place in
            the list), when the loaders track them; else empty.
    """

    def __init__(self, loaders: list, shares: list[int], remaps: list[list[int]], total_samples: int,
                 batch_size: int, world_size: int, dataset: ShardData | None = None):
        self.loaders, self.shares, self.batch_size, self.dataset = loaders, shares, batch_size, dataset
        self.remaps = [torch.tensor(r, dtype=torch.int64) for r in remaps]
        self.total_samples, self.world_size = total_samples, world_size
        self.batches = total_samples // world_size // batch_size  # >= 1: ShardData.check_batch_fits
        self.reserved = [own_epochs(self.batches, len(loader)) for loader in loaders]
        self.cursor = EpochCursor(batch_size * world_size)
        self._restore: list | None = None  # the dataset loaders' states the next iteration continues from
        self.last_samples: list[str] = []  # the last batch's samples: `DATASET/SHARD:POSITION`, DATASET its index

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self.batches

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch: `len(loader) * batch_size`."""
        return self.batches * self.batch_size

    def state_dict(self) -> dict:
        """Where this loader is, for a checkpoint: the epoch and the samples of it consumed by all ranks and,
        between two batches of an epoch, every folder's loader state (which needs `checkpointing=True`)."""
        if self.cursor.samples_done == 0:
            return {**self.cursor.state_dict(), "datasets": None}
        return {**self.cursor.state_dict(), "datasets": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue from a saved position.

        Args:
            state: `state_dict()` of a loader made with the same arguments.
        """
        self.cursor.load_state_dict(state)
        self._restore = state["datasets"]
        self._ahead = True

    def _stream(self, i: int):
        loader = self.loaders[i]
        while True:
            yield from loader  # one of its own epochs a pass; the loader moves to its next epoch itself

    def __iter__(self):
        """One epoch's `(images, labels)` batches, each folder's share concatenated in the list's order; the
        next iteration reads the next epoch."""
        cursor = self.cursor
        restore, self._restore = self._restore, None
        if restore is not None:
            for loader, state in zip(self.loaders, restore):
                loader.load_state_dict(state)
        else:
            cursor.start(cursor.epoch)
            for loader, reserved in zip(self.loaders, self.reserved):
                loader.set_epoch(cursor.epoch * reserved, ahead=self._ahead)
        streams = [self._stream(i) for i in range(len(self.loaders))]
        remaps = None
        left = batches_left(self.total_samples, cursor.samples_done, cursor.global_batch)
        for _ in range(left):
            parts = [next(stream) for stream in streams]
            if remaps is None:
                remaps = [r.to(parts[0][1].device) for r in self.remaps]
            images = torch.cat([p[0] for p in parts])
            labels = torch.cat([remap[p[1]] for remap, p in zip(remaps, parts)])
            self.last_samples = [f"{i}/{key}" for i, loader in enumerate(self.loaders)
                                 for key in loader.last_samples]
            cursor.advance()
            yield images, labels
        for stream in streams:
            stream.close()
        cursor.finish()


class ConcatLoader:
    """Validation over several shard folders: each folder's loader in turn, every sample once, labelled in
    the union of the folders' classes; what `make_loader` returns for a validation split of mixed data.

    Args:
        per_dataset: Folder location -> that folder's loader, its labels mapped into the union's classes; a
            loop that reports each folder apart iterates these one by one.
    """

    def __init__(self, per_dataset: dict[str, RemappedLoader]):
        self.per_dataset = per_dataset

    def __len__(self) -> int:
        """Batches this rank yields per epoch, all folders."""
        return sum(len(loader) for loader in self.per_dataset.values())

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch, all folders."""
        return sum(loader.num_samples for loader in self.per_dataset.values())

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration read epoch `epoch` in every folder.

        Args:
            epoch: The epoch, counted from 0.
        """
        for loader in self.per_dataset.values():
            loader.set_epoch(epoch)

    def __iter__(self):
        """Every folder's `(images, labels)` batches, one folder after the other."""
        for loader in self.per_dataset.values():
            yield from loader


def own_epochs(batches: int, loader_batches: int) -> int:
    """The most of its own epochs (of `loader_batches` batches) a dataset's loader can need in one mixed epoch
    of `batches` batches: in mixed epoch e it runs its epochs e * that, e * that + 1, ..."""
    return -(-batches // loader_batches)


def share_threads(threads: int, shares: list[int]) -> list[int]:
    """`threads` DALI threads dealt to pipelines that decode `shares` samples a batch each: in proportion,
    largest remainder first, at least one each (so more than `threads` in all only where there are more
    datasets than threads)."""
    exact = [threads * share / sum(shares) for share in shares]
    dealt = [max(1, int(x)) for x in exact]
    while sum(dealt) < threads:
        dealt[max(range(len(dealt)), key=lambda i: exact[i] - dealt[i])] += 1
    while sum(dealt) > max(threads, len(dealt)):
        dealt[max((i for i in range(len(dealt)) if dealt[i] > 1), key=lambda i: dealt[i] - exact[i])] -= 1
    return dealt


def mixed_loader(dataset: ShardData, options, make_one, size_schedule=None) -> MixedLoader | ConcatLoader:
    """The loader of a mixed `dataset` (see the module docstring) with `options` (a resolved, checked
    `loader.LoaderOptions`); `make_one(source, options, size_schedule)` makes one dataset's loader. Training: a
    `MixedLoader` whose dataset loaders run at their shares of the batch; evaluation: a `ConcatLoader`.
    `size_schedule` (training: mixed epoch -> image size, progressive resizing) is handed to each dataset's
    loader in its own epochs: its epoch s is part of mixed epoch s // (its `own_epochs`), so every part of a
    batch has the mixed epoch's size, also after a restore (each loader's state holds its own epoch)."""
    if not options.train:
        return ConcatLoader({source.location: RemappedLoader(make_one(source, options, None), source.remap)
                             for source in dataset.sources})
    shares = dataset.shares(options.batch_size)
    for source, share, weight in zip(dataset.sources, shares, dataset.weights):
        if share == 0:
            raise MixError(f"{source.location}: weight {weight} gives it no sample of a batch of "
                           f"{options.batch_size}: raise its weight or the batch size")
    totals = [source.manifest.num_samples(options.split) for source in dataset.sources]
    batches = sum(totals) // options.world_size // options.batch_size  # MixedLoader's, before its loaders exist
    loaders = []
    for source, share, total, threads in zip(dataset.sources, shares, totals,
                                             share_threads(options.num_threads, shares)):
        size = None
        # a DaliLoader's training epoch: (total // world) // batch (loader.py)
        reserved = own_epochs(batches, (total // options.world_size) // share)
        if size_schedule is not None:
            def size(epoch, reserved=reserved):
                return size_schedule(epoch // reserved)
        # mixed epoch e reads this loader's epochs from e * reserved on: the run's last, none from epochs * reserved
        epochs = options.epochs * reserved if options.epochs is not None else None
        loaders.append(make_one(source, replace(options, batch_size=share, num_threads=threads, epochs=epochs),
                                size))
    return MixedLoader(loaders, shares, [source.remap for source in dataset.sources],
                       sum(loader.total_samples for loader in loaders), options.batch_size, options.world_size,
                       dataset)
