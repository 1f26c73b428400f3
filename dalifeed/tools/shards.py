"""The sharded writer every converter shares: deterministic tars, DALI indexes, atomic renames, resume.

A conversion is a *plan* (per split, an ordered list of source items) and an *encode* function that turns
one item into tar members (or a skip reason). `write_split` runs encode over the plan in worker
processes, packs the results into shards in plan order, and records each finished shard in
`OUT/.dalifeed-progress/` so that a re-run continues after the last finished shard. Because the plan is
fixed by the seed and results are consumed in plan order, the bytes are the same for any worker count.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .manifest import ShardInfo, write_json_atomic

PROGRESS_DIR = ".dalifeed-progress"
TAR_BLOCK = 512
INDEX_VERSION = "v1.2"  # the version DALI's wds2idx writes and fn.readers.webdataset reads


class WorkerCrashed(Exception):
    """A worker process died (killed, out of memory) instead of returning or raising."""


@dataclass
class Sample:
    """One encoded sample: members in the order they go into the tar, e.g. [("jpg", b"..."), ("cls", b"3")]."""

    members: list[tuple[str, bytes]]
    reencoded: str | None = None


@dataclass
class Skip:
    reason: str


@dataclass
class ShardRecord:
    """What a finished shard contributed; written to the progress folder after its tar is renamed."""

    shard: ShardInfo
    next_position: int  # plan position of the first item not covered by this shard
    skipped: list[dict] = field(default_factory=list)
    reencoded: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "shard": asdict(self.shard)}

    @classmethod
    def from_json(cls, doc: dict) -> "ShardRecord":
        return cls(ShardInfo(**doc["shard"]), doc["next_position"], doc["skipped"], doc["reencoded"])


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}"


def sample_key(position: int) -> str:
    return f"{position:09d}"


def deterministic_tarinfo(name: str, size: int) -> tarfile.TarInfo:
    """A member header that depends only on name and size, so the same input gives the same bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def tar_member_bytes(size: int) -> int:
    """Bytes one member occupies in a USTAR tar: a header block plus its data padded to whole blocks."""
    return TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK


class _HashingFile(io.RawIOBase):
    """Write-through file wrapper that hashes and counts the bytes tarfile writes."""

    def __init__(self, f):
        self._f, self.sha256, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha256.update(b)
        self.size += len(b)
        return self._f.write(b)

    def tell(self) -> int:
        return self.size


class ShardFile:
    """One tar being written under a temporary name, with its DALI index built from the offsets as they
    are written (the same numbers `wds2idx` reads back with `tar --block-num`)."""

    def __init__(self, out_dir: Path, name: str):
        self.tar_path, self.idx_path = out_dir / f"{name}.tar", out_dir / f"{name}.idx"
        self._tmp_tar, self._tmp_idx = _tmp_name(self.tar_path), _tmp_name(self.idx_path)
        self._raw = open(self._tmp_tar, "wb")
        self._hashing = _HashingFile(self._raw)
        self._tar = tarfile.open(fileobj=self._hashing, mode="w", format=tarfile.USTAR_FORMAT)
        self._index_lines: list[str] = []
        self.samples = 0

    def add(self, key: str, members: Sequence[tuple[str, bytes]]) -> None:
        components = []
        for ext, payload in members:
            name = f"{key}.{ext}"
            components.append(f"{ext} {self._tar.offset + TAR_BLOCK} {len(payload)} {name}")
            self._tar.addfile(deterministic_tarinfo(name, len(payload)), io.BytesIO(payload))
        self._index_lines.append(" ".join(components))
        self.samples += 1

    @property
    def bytes_so_far(self) -> int:
        return self._tar.offset

    def finish(self) -> ShardInfo:
        """Close the tar, fsync, and rename index then tar into place (a tar present means finished)."""
        self._tar.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        index = f"{INDEX_VERSION} {self.samples}\n" + "".join(line + "\n" for line in self._index_lines)
        with open(self._tmp_idx, "w") as f:
            f.write(index)
        os.replace(self._tmp_idx, self.idx_path)
        os.replace(self._tmp_tar, self.tar_path)
        return ShardInfo(self.tar_path.name, self.idx_path.name, self.samples, self._hashing.size,
                         self._hashing.sha256.hexdigest())

    def abandon(self) -> None:
        self._raw.close()
        for p in (self._tmp_tar, self._tmp_idx):
            p.unlink(missing_ok=True)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def ordered_map(fn: Callable, items: Sequence, workers: int, chunk: int = 16) -> Iterator:
    """`map(fn, items)` over `workers` processes, results in input order, at most a few chunks in flight
    (so memory stays flat on a million files). A worker's exception is re-raised here; a worker that dies
    raises `WorkerCrashed` instead of hanging."""
    if workers <= 1:
        yield from map(fn, items)
        return
    chunks = (items[i : i + chunk] for i in range(0, len(items), chunk))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending: deque = deque()
        try:
            for part in chunks:
                pending.append(pool.submit(_map_chunk, fn, part))
                if len(pending) >= 4 * workers:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        except BrokenProcessPool as e:
            raise WorkerCrashed(f"a conversion worker process died ({e}); re-run the same command to resume") from None
        finally:
            for future in pending:
                future.cancel()


def _map_chunk(fn: Callable, part: Sequence) -> list:
    return [fn(item) for item in part]


class ProgressStore:
    """The resume state: a fingerprint of what is being made, and one record per finished shard."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir / PROGRESS_DIR

    def exists(self) -> bool:
        return (self.dir / "fingerprint.json").is_file()

    def fingerprint(self) -> dict | None:
        try:
            return json.loads((self.dir / "fingerprint.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def start(self, fingerprint: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "fingerprint.json", fingerprint)

    def save(self, split: str, number: int, record: ShardRecord) -> None:
        write_json_atomic(self.dir / f"{shard_name(split, number)}.json", record.to_json())

    def finished(self, split: str, out_dir: Path) -> list[ShardRecord]:
        """Consecutive finished shards of `split` from number 0, stopping at the first whose record or
        files are missing or whose tar has the wrong size (that one and later ones get rewritten)."""
        records = []
        for number in range(10**6):
            path = self.dir / f"{shard_name(split, number)}.json"
            if not path.is_file():
                break
            try:
                record = ShardRecord.from_json(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                break
            tar, idx = out_dir / record.shard.path, out_dir / record.shard.index
            if not (idx.is_file() and tar.is_file() and tar.stat().st_size == record.shard.bytes):
                break
            records.append(record)
        return records

    def remove(self) -> None:
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                p.unlink()
            self.dir.rmdir()


@dataclass
class SplitResult:
    shards: list[ShardInfo]
    skipped: list[dict]
    reencoded: dict[str, int]
    resumed_shards: int


def write_split(
    out_dir: Path,
    split: str,
    plan: Sequence,
    encode: Callable[[object], Sample | Skip],
    describe: Callable[[object], str],
    *,
    workers: int,
    max_shard_bytes: int | None,
    samples_per_shard: int | None,
    progress: ProgressStore,
    on_error: str = "skip",
    on_item: Callable[[], None] = lambda: None,
) -> SplitResult:
    """Encode `plan` in order and pack it into `out_dir/<split>-NNNNNN.tar` shards, resuming after the
    shards `progress` already records. `describe(item)` names an item in skip lists and errors."""
    done = progress.finished(split, out_dir)
    start = done[-1].next_position if done else 0
    for _ in range(start):
        on_item()
    shards = [r.shard for r in done]
    skipped = [s for r in done for s in r.skipped]
    reencoded: dict[str, int] = {}
    for r in done:
        _add_counts(reencoded, r.reencoded)

    number = len(done)
    current: ShardFile | None = None
    pending_skips: list[dict] = []
    pending_reencoded: dict[str, int] = {}

    def close_shard(next_position: int) -> None:
        nonlocal current, number, pending_skips, pending_reencoded
        info = current.finish()
        progress.save(split, number, ShardRecord(info, next_position, pending_skips, pending_reencoded))
        shards.append(info)
        skipped.extend(pending_skips)
        _add_counts(reencoded, pending_reencoded)
        current, number, pending_skips, pending_reencoded = None, number + 1, [], {}

    try:
        results = ordered_map(encode, plan[start:], workers)
        for position, result in enumerate(results, start=start):
            on_item()
            if isinstance(result, Skip):
                if on_error == "fail":
                    raise ConversionFailed(f"{describe(plan[position])}: {result.reason}")
                pending_skips.append({"path": describe(plan[position]), "reason": result.reason})
                continue
            size = sum(tar_member_bytes(len(payload)) for _, payload in result.members)
            if current is not None and _shard_full(current, size, max_shard_bytes, samples_per_shard):
                close_shard(position)
            if current is None:
                current = ShardFile(out_dir, shard_name(split, number))
            current.add(sample_key(position), result.members)
            if result.reencoded:
                _add_counts(pending_reencoded, {result.reencoded: 1})
        if current is not None:
            close_shard(len(plan))
    finally:
        if current is not None:
            current.abandon()
    # Skips after the last shard are not in any record: a resumed run simply re-derives them.
    skipped.extend(pending_skips)
    return SplitResult(shards, skipped, reencoded, len(done))


class ConversionFailed(Exception):
    """`--on-error fail` met a file it could not convert."""


def _shard_full(shard: ShardFile, next_size: int, max_bytes: int | None, max_samples: int | None) -> bool:
    if max_samples is not None:
        return shard.samples >= max_samples
    # + two zero blocks that close a tar: keep the finished file itself under the limit where possible
    return shard.bytes_so_far + next_size + 2 * TAR_BLOCK > max_bytes


def _add_counts(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def remove_outputs(out_dir: Path) -> None:
    """Delete what a conversion writes (shards, indexes, manifest, progress) and nothing else."""
    ours = re.compile(r"^\.?[A-Za-z0-9_]+-\d{6}\.(tar|idx)(\.tmp)?$")
    for p in out_dir.iterdir():
        if p.is_file() and (ours.match(p.name) or p.name in ("manifest.json", "convert.json")):
            p.unlink()
    ProgressStore(out_dir).remove()

