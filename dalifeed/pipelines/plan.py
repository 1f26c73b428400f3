"""An epoch's plan: which shards a loader's epoch reads and in what order, where from, which part is this rank's,
in how many lanes and with which seeds. A pure function of `(seed, epoch, rank)` and the manifest (and, for a
folder in a store, the node's shard cache the tars are fetched into), so that an epoch planned ahead, set by
`set_epoch` or restored mid-epoch is the epoch an uninterrupted run reads."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dalifeed.atomic import write_atomic
from dalifeed.format import ShardInfo, ShardManifest, index_samples, index_text

from .elastic import SampleSet, remaining_index
from .lanes import lane_files, lane_range, lane_sizes
from .shardcache import ShardCache

# files(manifest, shards) -> (tars, indexes): where DALI reads `shards` from
Files = Callable[[ShardManifest, list[ShardInfo]], tuple[list[str], list[str]]]


def epoch_files(manifest: ShardManifest, shards: list[ShardInfo]) -> tuple[list[str], list[str]]:
    """Where DALI reads `shards` of a local folder from, in order: the tars and their indexes (a store's
    folder reads through its shard cache instead)."""
    return [manifest.shard_location(s) for s in shards], [str(manifest.root / s.index) for s in shards]


class EpochPlan:
    """The plan of every epoch of `split` of `manifest` for the loader options `options` (lanes decided):
    `files` says where shards are read from, `shard_cache` (a folder in a store) fetches and pins them."""

    def __init__(self, manifest: ShardManifest, options, files: Files = epoch_files,
                 shard_cache: ShardCache | None = None):
        self.manifest, self.options, self.files, self.shard_cache = manifest, options, files, shard_cache
        self.shards = manifest.split_info(options.split).shards
        self.total_samples = manifest.num_samples(options.split)
        self._rest: tempfile.TemporaryDirectory | None = None  # index files of a resumed epoch's remaining samples

    def shard_range(self, shard_id: int, total: int | None = None) -> tuple[int, int]:
        """DALI's split of N samples (default: the split's) into `world_size` contiguous shards: shard
        `shard_id`'s [start, end)."""
        n, w = self.total_samples if total is None else total, self.options.world_size
        return n * shard_id // w, n * (shard_id + 1) // w

    def epoch_shards(self, epoch: int) -> list[ShardInfo]:
        """The split's shards in the order epoch `epoch` reads them: validation's as written, training's in a
        permutation seeded by (seed, epoch), the same on every rank (so the ranks' slices partition it)."""
        if not self.options.train:
            return list(self.shards)
        order = list(range(len(self.shards)))
        random.Random(f"{self.options.seed}:{epoch}").shuffle(order)
        return [self.shards[i] for i in order]

    def epoch_files(self, shards: list[ShardInfo], epoch: int) -> tuple[list[str], list[str]]:
        """`files` of epoch `epoch`'s `shards`; from a store with a shard cache, the local copies of this rank's
        tars, fetched whole first (and the next epoch's started in the background: shardcache.py)."""
        if self.shard_cache is None:
            return self.files(self.manifest, shards)
        rank_range = self.shard_range(self.options.rank, sum(s.samples for s in shards))
        tars = self.shard_cache.epoch_files(shards, rank_range, upcoming=self.epoch_shards(epoch + 1))
        return tars, [str(self.manifest.root / s.index) for s in shards]

    def remaining(self, shards: list[ShardInfo], excluded: SampleSet) -> tuple[list[ShardInfo], list[str]]:
        """The epoch's shards with samples not in `excluded` (each counting only those) and index files listing
        only them, written to a folder kept until `end_rest`."""
        if self._rest is None:
            self._rest = tempfile.TemporaryDirectory(prefix="dalifeed-rest-")
        kept, indexes = [], []
        for shard in shards:
            out = Path(self._rest.name) / f"{len(kept)}-{Path(shard.index).name}"
            samples = remaining_index(self.manifest.root / shard.index, excluded.of(shard.path), out)
            if samples:  # a shard read whole is left out: DALI refuses an index of no samples
                kept.append(replace(shard, samples=samples))
                indexes.append(str(out))
        return kept, indexes

    def lane_files(self, tars: list[str], indexes: list[str], counts: list[int], lanes: int, lane: int,
                   cuts: Path) -> tuple[list[str], list[str]] | None:
        """The tars and indexes lane `lane` (of `lanes`) of this rank reads of an epoch's `tars` (with `indexes`
        listing `counts` samples): only those holding its samples, the first and last through index files cut to
        them, written in the folder `cuts`, which a reader given them reads whole (shard 0 of 1) as it read its
        shard of all. DALI maps or opens every tar its reader is given (lanes.py); None for a lane of no samples
        (given every tar, as a rank with none is)."""
        o = self.options
        start, end = lane_range(sum(counts), o.rank, o.world_size, lanes, lane)
        parts = lane_files(counts, start, end)
        if not parts:
            return None
        lane_tars, lane_indexes = [], []
        for i, first, samples in parts:
            lane_tars.append(tars[i])
            if samples == counts[i]:
                lane_indexes.append(indexes[i])
                continue
            out = cuts / f"{lane}-{first}-{Path(indexes[i]).name}"
            write_atomic(out, index_text(list(index_samples(indexes[i]))[first:first + samples]).encode())
            lane_indexes.append(str(out))
        return lane_tars, lane_indexes

    def end_rest(self) -> None:
        """The epoch resumed on other ranks is over: its remaining-sample index files go."""
        if self._rest is not None:
            self._rest.cleanup()
            self._rest = None

    def pipeline_seed(self, epoch: int, resumed_at: int = 0, lane: int = 0) -> int:
        """Distinct per rank and lane (different augmentations) and per epoch, and for the rest of an epoch
        shared out anew after `resumed_at` samples (the same again when that rest is itself restored); below
        2**31 as DALI requires."""
        rest = f":{resumed_at}" if resumed_at else ""
        lane_of = f"/{lane}" if lane else ""
        return random.Random(f"{self.options.seed}:{epoch}:{self.options.rank}{lane_of}{rest}").randrange(2**31)

    def epoch_lanes(self, total: int) -> int:
        """Lanes of an epoch whose pipelines read `total` samples: `options.lanes`, unless a lane would hold
        less than a batch (then one: a small split, or little of an epoch left)."""
        o = self.options
        return o.lanes if min(lane_sizes(total, o.rank, o.world_size, o.lanes)) >= o.batch_size else 1

    def lane_sizes(self, total: int, lanes: int) -> list[int]:
        return lane_sizes(total, self.options.rank, self.options.world_size, lanes)
