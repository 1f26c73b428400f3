"""The sharded writer every converter shares: deterministic tars, DALI indexes, atomic renames, resume.

A conversion is a *plan* (per split, an ordered list of source items) and an *encode* function that turns
one item into tar members (or a skip reason). `write_split` runs encode over the plan in worker
processes, packs the results into shards in plan order, and records each finished shard in
`OUT/.dalifeed-progress/` so that a re-run continues after the last finished shard. Because the plan is
fixed by the seed and results are consumed in plan order, the bytes are the same for any worker count.
"""

from __future__ import annotations

import functools
import hashlib
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

from ..atomic import write_json_atomic
from ..format import INDEX_VERSION, TAR_BLOCK, ShardInfo

PROGRESS_DIR = ".dalifeed-progress"


class WorkerCrashed(Exception):
    """A worker process died (killed, out of memory) instead of returning or raising."""


@dataclass
class SourceFile:
    """A member whose bytes are a source file's, unchanged. Workers pass this instead of the bytes and the
    writer reads the file itself (from the page cache): shipping every JPEG back through a pipe cost
    conversion a fifth of its speed."""

    path: str
    size: int

    def read(self) -> bytes:
        try:
            data = Path(self.path).read_bytes()
        except OSError as e:
            raise SourceChanged(f"{self.path}: vanished while being converted ({e.strerror})") from None
        if len(data) != self.size:
            raise SourceChanged(f"{self.path}: changed while being converted ({self.size} -> {len(data)} bytes)")
        return data


class ConversionFailed(Exception):
    """The conversion cannot go on: `--on-error fail` met a bad file, or a source changed under it."""


class SourceChanged(ConversionFailed):
    pass


@dataclass
class Sample:
    """One encoded sample: members in the order they go into the tar, e.g. [("jpg", b"..."), ("cls", b"3")]."""

    members: list[tuple[str, bytes | SourceFile]]
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


@dataclass
class PackedSample:
    """A sample already laid out as tar members (headers, data, padding), built in a worker so the writer
    only appends bytes. USTAR headers do not depend on their position, so this is exact."""

    parts: list[bytes | SourceFile]  # concatenated, they are the sample's tar bytes
    entries: list[tuple[str, int, int, str]]  # (ext, data offset inside the sample, size, member name)
    reencoded: str | None

    @property
    def size(self) -> int:
        return sum(p.size if isinstance(p, SourceFile) else len(p) for p in self.parts)


def pack_sample(key: str, sample: Sample) -> PackedSample:
    parts, entries, offset = [], [], 0
    for ext, payload in sample.members:
        name = f"{key}.{ext}"
        size = payload.size if isinstance(payload, SourceFile) else len(payload)
        header = deterministic_tarinfo(name, size).tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
        padding = b"\0" * (-size % TAR_BLOCK)
        entries.append((ext, offset + len(header), size, name))
        parts += [header, payload, padding]
        offset += len(header) + size + len(padding)
    return PackedSample(parts, entries, sample.reencoded)


class ShardFile:
    """One tar being written under a temporary name, hashed as it goes, with its DALI index built from the
    offsets as they are written (the numbers `wds2idx` reads back with `tar --block-num`)."""

    def __init__(self, out_dir: Path, name: str):
        self.tar_path, self.idx_path = out_dir / f"{name}.tar", out_dir / f"{name}.idx"
        self._tmp_tar, self._tmp_idx = _tmp_name(self.tar_path), _tmp_name(self.idx_path)
        self._file = open(self._tmp_tar, "wb")
        self._sha256 = hashlib.sha256()
        self._index_lines: list[str] = []
        self.bytes_so_far = 0
        self.samples = 0

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha256.update(data)
        self.bytes_so_far += len(data)

    def add(self, packed: PackedSample) -> None:
        base = self.bytes_so_far
        self._index_lines.append(" ".join(f"{ext} {base + off} {size} {name}" for ext, off, size, name in packed.entries))
        for part in packed.parts:
            self._write(part.read() if isinstance(part, SourceFile) else part)
        self.samples += 1

    def finish(self) -> ShardInfo:
        """End the archive as tarfile does, fsync, and rename index then tar (a tar present means finished)."""
        end = self.bytes_so_far + 2 * TAR_BLOCK
        self._write(b"\0" * (2 * TAR_BLOCK + (-end % tarfile.RECORDSIZE)))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        index = f"{INDEX_VERSION} {self.samples}\n" + "".join(line + "\n" for line in self._index_lines)
        with open(self._tmp_idx, "w") as f:
            f.write(index)
        os.replace(self._tmp_idx, self.idx_path)
        os.replace(self._tmp_tar, self.tar_path)
        return ShardInfo(self.tar_path.name, self.idx_path.name, self.samples, self.bytes_so_far,
                         self._sha256.hexdigest())

    def abandon(self) -> None:
        self._file.close()
        for p in (self._tmp_tar, self._tmp_idx):
            p.unlink(missing_ok=True)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def ordered_map(fn: Callable, items: Sequence, workers: int, chunk: int = 64) -> Iterator:
    """`map(fn, items)` over `workers` processes, results in input order, at most a few chunks in flight
    (so memory stays flat on a million files). A worker's exception is re-raised here; a worker that dies
    raises `WorkerCrashed` instead of hanging."""
    if workers <= 1:
        yield from map(fn, items)
        return
    chunks = (items[i : i + chunk] for i in range(0, len(items), chunk))  # 64: measured best of 4..64
    with ProcessPoolExecutor(max_workers=workers, mp_context=_worker_context()) as pool:
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


def _worker_context():
    """fork where the OS has it: workers start in milliseconds and scripts need no `__main__` guard. The
    workers only run PIL on bytes, never threads or CUDA state inherited from the parent."""
    import multiprocessing

    return get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


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
    on_items: Callable[[int], None] = lambda n: None,
) -> SplitResult:
    """Encode `plan` in order and pack it into `out_dir/<split>-NNNNNN.tar` shards, resuming after the
    shards `progress` already records. `describe(item)` names an item in skip lists and errors."""
    done = progress.finished(split, out_dir)
    start = done[-1].next_position if done else 0
    on_items(start)
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
        work = [(position, plan[position]) for position in range(start, len(plan))]
        results = ordered_map(functools.partial(_encode_and_pack, encode), work, workers)
        for position, result in enumerate(results, start=start):
            on_items(1)
            if isinstance(result, Skip):
                if on_error == "fail":
                    raise ConversionFailed(f"{describe(plan[position])}: {result.reason}")
                pending_skips.append({"path": describe(plan[position]), "reason": result.reason})
                continue
            if current is not None and _shard_full(current, result.size, max_shard_bytes, samples_per_shard):
                close_shard(position)
            if current is None:
                current = ShardFile(out_dir, shard_name(split, number))
            current.add(result)
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


def _encode_and_pack(encode: Callable, work: tuple[int, object]) -> PackedSample | Skip:
    position, item = work
    result = encode(item)
    return result if isinstance(result, Skip) else pack_sample(sample_key(position), result)


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

