"""Lanes: one rank's epoch read by several pipelines, whole batches taken from each in turn.

Why: on the CPU, one DALI pipeline leaves cores idle, the more so the more operators its graph has. Its executor
spends a fixed cost of one thread on every operator of every batch (docs/benchmarks.md), and a policy's
operators each run on the few samples of their branch, so its threads wait on each other at every operator.
Two pipelines of one thread each keep the same cores busier than one of two threads, and so make more batches
on them (docs/benchmarks.md, "Lanes, and one definition per loader"). The graph is the same: only how many
run it and on which samples. A lane's first batch is a whole batch of its one thread, so the loader starts the
next epoch's lanes before an epoch ends, and uses two from epochs of 24 batches (`loader.default_lanes`).

How: lane k of rank r reads DALI shard r * K + k of world * K, and the union of a rank's K lane shards is
exactly the shard it reads alone (DALI splits N samples at N * i // shards). Its reader is given only the tars
holding those samples (`lane_files`; the two at its ends through cut indexes) and reads them whole: DALI reserves
a mapping for every tar a reader is given, from a budget of half `vm.max_map_count` per process, and opens each
tar past it for the pipeline's life (`mapping_budget`). Each lane makes whole batches of
the loader's batch size, so a batch is one lane's DALI output, handed out without a copy. A lane's shard ends
in a partial batch; the lanes' partial batches are joined (the one copy of the epoch) into the epoch's last
batch or batches. The order is a pure function of the lane sizes: `next_lane` takes the lane that has handed
out the fewest batches among those with whole batches left, so a state restored mid-epoch (each lane's DALI
checkpoint and batch count) continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .checks import mapping_budget


def lane_sizes(total: int, rank: int, world_size: int, lanes: int) -> list[int]:
    """Samples read by each lane of `rank`: DALI's shards rank * lanes + k of world_size * lanes of `total`."""
    shards = world_size * lanes
    bounds = [total * (rank * lanes + k) // shards for k in range(lanes + 1)]
    return [end - start for start, end in zip(bounds, bounds[1:])]


def lane_range(total: int, rank: int, world_size: int, lanes: int, lane: int) -> tuple[int, int]:
    """[start, end) of `total` samples read by lane `lane` of `rank`: DALI's shard rank * lanes + lane of
    world_size * lanes."""
    shard, shards = rank * lanes + lane, world_size * lanes
    return total * shard // shards, total * (shard + 1) // shards


def lane_files(counts: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """The files holding samples [start, end) of files of `counts` samples read in order: (file, its first sample
    read, samples read) of each, the first and last possibly cut. A lane's reader is given these alone: DALI
    keeps every file it is given mapped (or open) for the pipeline's life, from a process-wide budget."""
    out, position = [], 0
    for i, count in enumerate(counts):
        first, last = max(start, position), min(end, position + count)
        if first < last:
            out.append((i, first - position, last - first))
        position += count
        if position >= end:
            break
    return out


def mappings_fit(pipes: list) -> bool:
    """Whether the readers of `pipes`, built together, keep their tars mapped (`mapping_budget`), not open."""
    return sum(getattr(pipe, "dalifeed_tars", 0) for pipe in pipes) <= mapping_budget()


def next_lane(handed: list[int], whole: list[int]) -> int | None:
    """The lane whose whole batch comes next: the fewest handed out among lanes with whole batches left (ties:
    the lowest lane), None when every lane's whole batches are out."""
    open_lanes = [k for k in range(len(handed)) if handed[k] < whole[k]]
    return min(open_lanes, key=lambda k: (handed[k], k)) if open_lanes else None


def batch_rows(outputs: dict) -> int:
    return next(iter(outputs.values())).shape[0]


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several batches of one output as one; trailing dimensions that differ (the zero-padded sample
    sources: each batch padded to its own longest) are zero-padded to the largest."""
    shape = [max(sizes) for sizes in zip(*(p.shape[1:] for p in parts))]
    padded = []
    for part in parts:
        pad = [x for size, have in zip(reversed(shape), reversed(part.shape[1:])) for x in (0, size - have)]
        padded.append(torch.nn.functional.pad(part, pad) if any(pad) else part)
    return torch.cat(padded)


class LaneBatches:
    """The batches of one epoch of `iterators` (one per lane, each an `EpochIterator` over its lane's shard
    of `sizes[k]` samples, yielding its partial last batch) in lane order (`next_lane`), then their partial
    batches joined in chunks of `batch_size` (the last chunk may be partial). `handed`: whole batches each
    lane handed out before its checkpoint (a restored state); `checkpoints()` and `handed` are what a
    mid-epoch state saves. One lane is its iterator's batches as they come."""

    def __init__(self, iterators: list, sizes: list[int], batch_size: int, handed: list[int] | None = None):
        self.iterators, self.batch_size = iterators, batch_size
        self.whole = [size // batch_size for size in sizes]
        self.handed = list(handed) if handed is not None else [0] * len(iterators)
        self._rest = [size % batch_size for size in sizes]  # each lane's samples after its whole batches

    def checkpoints(self) -> list[bytes]:
        return [iterator.checkpoints()[0] for iterator in self.iterators]

    @property
    def pipes(self) -> list:
        return [pipe for iterator in self.iterators for pipe in iterator._pipes]

    def __iter__(self) -> Iterator[dict]:
        if len(self.iterators) == 1:
            for batch in self.iterators[0]:
                yield batch[0]
            return
        while (lane := next_lane(self.handed, self.whole)) is not None:
            outputs = next(self.iterators[lane])[0]
            self.handed[lane] += 1
            yield outputs
        yield from self._joined_partials()

    def _joined_partials(self) -> Iterator[dict]:
        """The rest of each lane's epoch, joined. DALI's iterator counts every lane's epoch in the largest lane's
        size (`pad_last_batch`), so a lane one sample shorter whose size is a whole number of batches ends with
        a batch of no samples: what is left of a lane is read to its end and only rows are kept."""
        parts = []
        for iterator in self.iterators:
            while (batch := next(iterator, None)) is not None:  # `next`: DALI's `iter()` resets an iterator
                if batch_rows(batch[0]):
                    parts.append(batch[0])
        rows = sum(batch_rows(part) for part in parts)
        expected = sum(self._rest)
        if rows != expected:
            raise RuntimeError(f"the lanes' last batches hold {rows} samples, their shards {expected}")
        if not parts:
            return
        joined = {name: join_rows([part[name] for part in parts]) for name in parts[0]}
        for start in range(0, rows, self.batch_size):
            yield {name: value[start:start + self.batch_size] for name, value in joined.items()}
