"""Elastic mid-epoch resume: which samples of an epoch have been consumed, as a fact about the epoch (not a
list of per-rank reader positions), and the rest of the epoch served to another number of ranks.

DALI's reader shuffles through a buffer of `initial_fill` samples, so what a rank has consumed after k batches
is not a prefix of its slice: it is known only by looking. A training loader that checkpoints asks its graph
for each sample's `source_info` (DALI's `get_property`: `TAR:OFFSET:MEMBER` for the webdataset reader), turns
each into (shard, position in the shard's index) and keeps the positions it has handed out in a `SampleSet`.
A mid-epoch checkpoint holds every rank's set; `merge_rank_states` joins them into the epoch's consumed set.
A loader given that set reads the epoch's remaining samples through index files that list only them
(`remaining_index`), written to a folder of its own: the tars are not touched, DALI shards the remaining
samples over the new number of ranks, and the epoch still trains each sample once.

How many batches the rest of an epoch holds: an epoch trains floor(N / G) batches of the global batch G
(floor(floor(N / W) / B) with G = W * B, whatever W), so after `samples_done` samples,
floor((N - samples_done) / G) remain, on any number of ranks that shares G (`batches_left`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dalifeed.atomic import write_atomic
from dalifeed.format import IMAGE_MEMBER, index_samples, index_text

from .checks import indexed_samples


class ElasticError(ValueError):
    """A mid-epoch state that cannot be shared out anew (written before samples were recorded, or ranks that
    disagree): resume it on as many ranks as saved it."""


def batches_left(total_samples: int, samples_done: int, global_batch: int) -> int:
    """Full global batches of an epoch of `total_samples` after `samples_done` (module docstring)."""
    return max(0, total_samples - samples_done) // global_batch


@dataclass
class SampleSet:
    """Samples of one split, by shard (its path in the manifest) and position in the shard's index."""

    bits: dict[str, np.ndarray] = field(default_factory=dict)  # shard path -> bool per sample

    def add(self, shard: str, size: int, positions) -> None:
        marks = self.bits.get(shard)
        if marks is None:
            marks = self.bits[shard] = np.zeros(size, dtype=bool)
        marks[positions] = True

    def update(self, other: SampleSet) -> None:
        for shard, marks in other.bits.items():
            self.add(shard, len(marks), np.flatnonzero(marks))

    def count(self) -> int:
        """Distinct samples in the set."""
        return int(sum(marks.sum() for marks in self.bits.values()))

    def of(self, shard: str) -> np.ndarray | None:
        return self.bits.get(shard)

    def to_state(self) -> dict:
        """A compact, picklable form: per shard its size and its marks packed 8 to a byte."""
        return {shard: (len(marks), np.packbits(marks).tobytes()) for shard, marks in self.bits.items()}

    @classmethod
    def from_state(cls, state: dict | None) -> SampleSet:
        out = cls()
        for shard, (size, packed) in (state or {}).items():
            out.bits[shard] = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=size).astype(bool)
        return out


class SampleKeys:
    """Turns the `source_info` DALI gives for a sample of one pipeline into (shard path, position in its
    manifest index). `tars[i]` is where the pipeline reads `shards[i]` from (a path, an s3:// URL or the
    shard cache's copy: what DALI names), `indexes[i]` the shard's own full index (not a remaining one)."""

    def __init__(self, tars: list[str], shards: list, indexes: list[str]):
        self._where = {str(tar): (shard, idx) for tar, shard, idx in zip(tars, shards, indexes)}
        self._offsets: dict[str, np.ndarray] = {}

    def add(self, seen: SampleSet, infos) -> list[str]:
        """Mark in `seen` the samples named by `infos` (a (B, L) uint8 array of zero-padded `source_info`);
        returns them as `SHARD:POSITION`, in batch order."""
        found: dict[str, list[int]] = {}
        read = []
        for row in np.asarray(infos):
            tar, offset, _member = bytes(row).rstrip(b"\0").decode().rsplit(":", 2)
            found.setdefault(tar, []).append(int(offset))
            read.append((tar, int(offset)))
        names = {}
        for tar, offsets in found.items():
            shard, idx = self._where[tar]
            known = self._offsets.get(tar)
            if known is None:  # the offset of each sample's image member (what `source_info` names), in order
                known = self._offsets[tar] = np.asarray([ref.offset for ref in indexed_samples(tar, idx, IMAGE_MEMBER)],
                                                        dtype=np.int64)
            positions = np.searchsorted(known, offsets)
            if np.any(positions >= len(known)) or np.any(known[np.minimum(positions, len(known) - 1)] != offsets):
                raise ElasticError(f"{tar}: DALI read a sample at an offset its index {idx} does not list")
            seen.add(shard.path, len(known), positions)
            names.update({(tar, offset): f"{shard.path}:{i}" for offset, i in zip(offsets, positions)})
        return [names[x] for x in read]


def remaining_index(index_path: str | os.PathLike, consumed: np.ndarray | None, out: Path) -> int:
    """Write to `out` the DALI index of `index_path` without the samples marked in `consumed` (their entries
    as they are: the tar is read at the same offsets), through the one index reader and writer; returns how
    many samples it lists."""
    samples = list(index_samples(index_path))
    if consumed is not None:
        samples = [entries for entries, done in zip(samples, consumed) if not done]
    write_atomic(out, index_text(samples).encode())
    return len(samples)


NOT_RECORDED = ("the mid-epoch checkpoint does not record which samples were consumed (written by an older dalifeed, "
                "or without sample tracking)")


def merge_rank_states(states: list[dict]) -> dict:
    """The state of a training loader (DaliLoader, MixedLoader or SyntheticLoader) that every rank of another
    number of ranks loads: from one state per saving rank, the cursor they share and, inside an epoch, the
    samples consumed by all of them together (what their loaders excluded plus what each handed out), with
    no reader checkpoint (the remaining samples are shared out anew). ElasticError when the states cannot be
    merged."""
    if any("samples_done" not in state for state in states):  # per-rank batch counts, before the cursor was global
        raise ElasticError(NOT_RECORDED)
    first = states[0]
    cursor = {"epoch": first["epoch"], "samples_done": first["samples_done"]}
    for state in states[1:]:
        if (state["epoch"], state["samples_done"]) != (cursor["epoch"], cursor["samples_done"]):
            raise ElasticError(f"the ranks' loader states disagree (epoch {state['epoch']} at {state['samples_done']} "
                               f"samples against epoch {cursor['epoch']} at {cursor['samples_done']})")
    if "datasets" in first:  # a MixedLoader: its cursor and each dataset loader's state
        parts = [s["datasets"] for s in states]
        merged = None if parts[0] is None else [merge_rank_states(list(p)) for p in zip(*parts)]
        return {**cursor, "datasets": merged}
    if first.get("dali") is None:  # between epochs, or a loader with no reader (SyntheticLoader)
        return {**cursor, "dali": None}
    if any(s.get("seen") is None for s in states):
        raise ElasticError(NOT_RECORDED)
    consumed = SampleSet.from_state(first.get("excluded"))
    recorded = consumed.count()
    for state in states:
        seen = SampleSet.from_state(state["seen"])
        consumed.update(seen)
        recorded += seen.count()
    if recorded != consumed.count():
        raise ElasticError(f"the ranks recorded {recorded - consumed.count()} samples more than once (the states of "
                           f"one rank given twice?)")
    if consumed.count() != cursor["samples_done"]:
        raise ElasticError(f"the ranks recorded {consumed.count()} distinct samples consumed where their cursor "
                           f"counts {cursor['samples_done']}")
    return {**cursor, "dali": None, "excluded": consumed.to_state()}
