"""The sharded writer every converter shares: deterministic tars, DALI indexes, atomic renames, resume.

A conversion is a *plan* (per split, an ordered list of source items) and an *encode* function that turns
one item into tar members (or a skip reason). `write_split` runs encode over the plan in worker
processes (`ordered_map`) and hands the results, in plan order, to a `ShardWriter`, which packs them into
shards and records each finished shard in `OUT/.dalifeed-progress/` so that a re-run continues after the
last finished shard. Because the plan is fixed by the seed and results are consumed in plan order, the
bytes are the same for any worker count.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

from ..atomic import temp_name, write_atomic, write_json_atomic
from ..format import TAR_BLOCK, IndexEntry, ShardInfo, file_sha256, index_text
from ..runtime import DiskFull, die_with_parent, is_disk_full

PROGRESS_DIR = ".dalifeed-progress"
JOBS_DIR = ".dalifeed-jobs"


class WorkerCrashed(Exception):
    """A worker process died (killed, out of memory) instead of returning or raising."""


@dataclass
class SourceFile:
    """A member whose bytes are a source file's, unchanged. Workers pass this instead of the bytes and the
    writer reads the file itself (from the page cache): shipping every JPEG back through a pipe cost
    conversion a fifth of its speed."""

    path: str
    size: int
    offset: int = 0  # where the bytes start: a TFRecord's image lies inside its file

    def read(self) -> bytes:
        try:
            if self.offset:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(self.size)
            else:
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
    """One encoded sample: members in the order they go into the tar, e.g. [("jpg", b"..."), ("cls", b"3")],
    why its image was re-encoded (None: passed through), and the class indices it holds (for the
    manifest's per-class counts)."""

    members: list[tuple[str, bytes | SourceFile]]
    reencoded: str | None = None
    classes: tuple[int, ...] = ()
    warnings: list[str] = field(default_factory=list)  # kept in the manifest's `warnings`
    counts: dict[str, int] = field(default_factory=dict)  # converter-specific tallies, summed into the manifest


@dataclass
class Skip:
    reason: str


@dataclass
class Totals:
    """What a part of a conversion adds to the manifest: one shard, a split, a job's share of a split, every
    job's. Parts are added in the order a single job writes them, so that the lists come out in its order;
    the tallies are sums. `jobs.add_up` turns them into the manifest."""

    shards: list[ShardInfo] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"path", "reason"} of each item that gave no sample
    reencoded: dict[str, int] = field(default_factory=dict)  # why images were re-encoded -> how many
    classes: dict[str, int] = field(default_factory=dict)  # class index (as JSON keys are) -> samples holding it
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # converter-specific tallies (COCO: boxes, ...)

    def add(self, more: Totals) -> Totals:
        """Add `more` to these totals (its lists after these ones) and return them."""
        self.shards += more.shards
        self.skipped += more.skipped
        self.warnings += more.warnings
        for mine, theirs in ((self.reencoded, more.reencoded), (self.classes, more.classes),
                             (self.counts, more.counts)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        return self

    @classmethod
    def sum(cls, parts: Iterable[Totals]) -> Totals:
        """The parts added up, in order, into new totals (none of the parts changes)."""
        total = cls()
        for part in parts:
            total.add(part)
        return total

    def add_sample(self, sample: PackedSample) -> None:
        self.add(Totals(reencoded={sample.reencoded: 1} if sample.reencoded else {},
                        classes={str(c): 1 for c in set(sample.classes)}, warnings=sample.warnings,
                        counts=sample.counts))

    def class_counts(self, num_classes: int) -> list[int]:
        """Samples holding each class, by class index: the manifest's per-split `class_counts`."""
        return [self.classes.get(str(label), 0) for label in range(num_classes)]


@dataclass
class ShardRecord:
    """What a finished shard contributed (itself, and the skips, re-encodes, classes, warnings and tallies of
    the plan positions it covers); written to the progress folder after its tar is renamed."""

    totals: Totals  # totals.shards == [the shard]
    next_position: int  # plan position of the first item not covered by this shard

    @property
    def shard(self) -> ShardInfo:
        return self.totals.shards[0]

    def to_json(self) -> dict:
        totals = {k: v for k, v in asdict(self.totals).items() if k != "shards"}
        return {"shard": asdict(self.shard), "next_position": self.next_position, **totals}

    @classmethod
    def from_json(cls, doc: dict) -> ShardRecord:
        totals = Totals([ShardInfo.from_json(doc["shard"])], doc["skipped"], doc["reencoded"], doc.get("classes", {}),
                        doc.get("warnings", []), doc.get("counts", {}))
        return cls(totals, doc["next_position"])


def shard_name(prefix: str, number: int) -> str:
    return f"{prefix}-{number:06d}"


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
    classes: tuple[int, ...] = ()
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

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
    return PackedSample(parts, entries, sample.reencoded, sample.classes, sample.warnings, sample.counts)


class ShardFile:
    """One tar being written under a temporary name, hashed as it goes, with its DALI index built from the
    offsets as they are written (the numbers `wds2idx` reads back with `tar --block-num`)."""

    def __init__(self, out_dir: Path, name: str):
        self.tar_path, self.idx_path = out_dir / f"{name}.tar", out_dir / f"{name}.idx"
        self._tmp_tar = temp_name(self.tar_path)
        self._file = open(self._tmp_tar, "wb")
        self._sha256 = hashlib.sha256()
        self._index: list[list[IndexEntry]] = []  # per sample, its members
        self.bytes_so_far = 0
        self.samples = 0

    def _write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            if is_disk_full(e):
                raise DiskFull(f"{self.tar_path}: {e.strerror}") from e
            raise
        self._sha256.update(data)
        self.bytes_so_far += len(data)

    def add(self, packed: PackedSample) -> None:
        base = self.bytes_so_far
        self._index.append([(ext, base + off, size, name) for ext, off, size, name in packed.entries])
        for part in packed.parts:
            self._write(part.read() if isinstance(part, SourceFile) else part)
        self.samples += 1

    def finish(self) -> ShardInfo:
        """End the archive as tarfile does, fsync, and rename index then tar (a tar present means finished)."""
        end = self.bytes_so_far + 2 * TAR_BLOCK
        self._write(b"\0" * (2 * TAR_BLOCK + (-end % tarfile.RECORDSIZE)))
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            if is_disk_full(e):
                raise DiskFull(f"{self.tar_path}: {e.strerror}") from e
            raise
        self._file.close()
        index = index_text(self._index).encode()
        write_atomic(self.idx_path, index)
        os.replace(self._tmp_tar, self.tar_path)
        return ShardInfo(self.tar_path.name, self.idx_path.name, self.samples, self.bytes_so_far,
                         self._sha256.hexdigest(), hashlib.sha256(index).hexdigest())

    def abandon(self) -> None:
        try:
            self._file.close()
        except OSError:  # closing flushes what is being thrown away, and may fail as the write did (disk full)
            pass
        self._tmp_tar.unlink(missing_ok=True)



def ordered_map(fn: Callable, items: Sequence, workers: int, chunk: int = 64) -> Iterator:
    """`map(fn, items)` over `workers` processes, results in input order, at most a few chunks in flight
    (so memory stays flat on a million files). A worker's exception is re-raised here; a worker that dies
    raises `WorkerCrashed` instead of hanging. Left early (an error, Ctrl-C, the consumer stopping), the
    workers are killed, not waited for: one stuck on a file would hold the exit forever."""
    if workers <= 1:
        yield from map(fn, items)
        return
    chunks = (items[i : i + chunk] for i in range(0, len(items), chunk))  # 64: the fastest chunk tried, of 4..64
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_worker_context(), initializer=_start_worker,
                               initargs=(os.getpid(), dict(os.environ)))
    finished = returned = False
    try:
        pending: deque = deque()
        for part in chunks:
            pending.append(pool.submit(_map_chunk, fn, part))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().result()
                returned = True
        while pending:
            yield from pending.popleft().result()
            returned = True
        finished = True
    except BrokenProcessPool as e:
        script = None if returned else _unguarded_main_script()
        if script:
            raise WorkerCrashed(f"the conversion workers died as they started: each one runs {script} again first "
                                f"(Python's forkserver and spawn do), so its conversion must be under "
                                f"`if __name__ == \"__main__\":`") from None
        raise WorkerCrashed(f"a conversion worker process died ({e}); re-run the same command to resume") from None
    finally:
        if not finished:
            _kill_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a running task before Python 3.14's kill_workers();
    # `_processes` (pid -> Process) and `_result_queue` are there from 3.8 to 3.14
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=10)
    # a worker killed halfway through sending a result leaves half a message that the pool's thread would
    # wait on forever (and `shutdown` and the interpreter's exit with it); with our end of the result pipe
    # closed too, nothing can write the rest, so that thread reads end-of-file and stops
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()


# What a worker runs, imported once by the fork server rather than by every worker it starts
WORKER_MODULES = ["dalifeed.convert.shards", "dalifeed.convert.images", "dalifeed.convert.index", "PIL.Image"]


def _worker_context():
    """A fork server where the OS has one, spawn elsewhere. Not a plain fork of this process: it may have
    threads (a loader defining its next epoch's graph, DALI's, boto3's), and a child forked while one of them
    holds a lock (a module's import lock, the allocator's) waits for it forever. The server is a new process
    that has imported the workers' modules (`WORKER_MODULES`), so a worker forked from it starts in
    milliseconds; this is Python 3.14's default on Linux for the same reason. Like spawn, it runs a script's
    top level again in each worker: a script that converts must do so under `if __name__ == "__main__":`."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return get_context("spawn")
    context = get_context("forkserver")
    context.set_forkserver_preload(WORKER_MODULES)
    return context


def _start_worker(parent_pid: int, environ: dict[str, str]) -> None:
    """A worker dies with the process that started it, and sees its environment as it is now: a fork server
    forks workers with its own, the one of the moment it started (S3 credentials or an endpoint set since
    then would be missing)."""
    die_with_parent(parent_pid)
    os.environ.clear()
    os.environ.update(environ)


def _unguarded_main_script() -> str | None:
    """The script this process runs, if it has no `if __name__ == "__main__":` (None: run with -m, from a
    notebook, or a guarded script such as a console entry point)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return None
    try:
        return None if "__main__" in Path(path).read_text(errors="replace") else path
    except OSError:
        return None


def _map_chunk(fn: Callable, part: Sequence) -> list:
    return [fn(item) for item in part]


class ProgressStore:
    """The resume state in `folder`: a fingerprint of what is being made, and one record per finished shard
    (per split, numbered in the order the shards were finished)."""

    def __init__(self, folder: Path):
        self.dir = folder

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

    def save(self, split: str, sequence: int, record: ShardRecord) -> None:
        write_json_atomic(self.dir / f"{split}-{sequence:06d}.json", record.to_json())

    def flush(self) -> None:
        """Wait for what `save` started in the background (nothing here; uploads in an s3:// conversion)."""

    def records(self, split: str) -> list[ShardRecord]:
        """The consecutive readable records of `split`, in the order its shards were finished."""
        records = []
        for sequence in range(10**7):
            path = self.dir / f"{split}-{sequence:06d}.json"
            if not path.is_file():
                break
            try:
                records.append(ShardRecord.from_json(json.loads(path.read_text())))
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                break
        return records

    def finished(self, split: str, out_dir: Path) -> list[ShardRecord]:
        """The consecutive finished shards of `split`, stopping at the first whose record or files are missing
        or whose tar has the wrong size (that one and later ones get rewritten)."""
        records = []
        for record in self.records(split):
            tar, idx = out_dir / record.shard.path, out_dir / record.shard.index
            if not (idx.is_file() and tar.is_file() and tar.stat().st_size == record.shard.bytes):
                break
            if record.shard.index_sha256 is None:  # recorded by an older version
                record.shard.index_sha256 = file_sha256(idx)
            records.append(record)
        return records

    def remove(self) -> None:
        if self.dir.is_dir():
            shutil.rmtree(self.dir)


def describe_difference(old: dict, new: dict) -> str:
    """What changed between two fingerprints, e.g. "--seed was 1, now 2; source was /a, now /b"."""
    changes = [f"{name} was {old.get(name)}, now {new.get(name)}" for name in ("kind", "source", "num_jobs")
               if old.get(name) != new.get(name)]
    old_format, new_format = old.get("format_version", 1), new.get("format_version", 1)  # 1: written before it was
    if old_format != new_format:
        changes.append(f"shard format {old_format}, this dalifeed writes {new_format}")
    old_options, new_options = old.get("options", {}), new.get("options", {})
    for name in sorted(set(old_options) | set(new_options)):
        if old_options.get(name) != new_options.get(name):
            changes.append(f"--{name.replace('_', '-')} was {old_options.get(name)}, now {new_options.get(name)}")
    if not changes and old.get("listing_sha256") != new.get("listing_sha256"):
        changes.append("the source files changed since (added, removed, renamed or modified)")
    return "; ".join(changes) or "an older dalifeed version"


class ShardWriter:
    """Packs samples, in plan order, into `<prefix>-NNNNNN.tar` shards and records each finished shard in
    `progress` with what it contributed (skips, re-encode reasons, class counts, warnings), so that a re-run
    resumes after the last finished shard. Each shard is finished atomically with its DALI index.
    webdataset's ShardWriter, made atomic and resumable:

        with ShardWriter(out, "train", max_bytes=..., max_samples=None, progress=store) as writer:
            writer.write(packed, position)   # or writer.skip({"path": ..., "reason": ...})
            ...
            writer.finish(end_position)

    Shard boundaries: with `max_samples` alone, shard k holds plan positions [k * max_samples, (k + 1) *
    max_samples) (fewer samples where some were skipped), so every shard's content and name follow from
    the plan alone and separate jobs can write disjoint shards of one conversion. With `max_bytes`, a
    shard ends before it would exceed the limit (and with both, at whichever comes first), numbered in
    order from `first_number`.
    """

    def __init__(self, out_dir: Path, prefix: str, *, max_bytes: int | None, max_samples: int | None,
                 progress: ProgressStore, progress_key: str, first_number: int = 0, first_record: int = 0):
        self.out_dir, self.prefix, self.max_bytes, self.max_samples = out_dir, prefix, max_bytes, max_samples
        self.progress, self.progress_key = progress, progress_key
        self.aligned = max_bytes is None  # shard numbers follow from plan positions
        self.number, self.sequence = first_number, first_record
        self.records: list[ShardRecord] = []  # the shards finished by this writer
        self.current: ShardFile | None = None
        self.pending = Totals()  # what the open shard will record

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self.current is not None:  # an error or interruption: the open shard is dropped, not half-written
            self.current.abandon()
            self.current = None

    def write(self, sample: PackedSample, position: int) -> None:
        if self.aligned:
            if self.current is not None and position // self.max_samples != self.number:
                self._close(next_position=position)
            self.number = position // self.max_samples
        elif self.current is not None and self._full(sample.size):
            self._close(next_position=position)
        if self.current is None:
            self.current = ShardFile(self.out_dir, shard_name(self.prefix, self.number))
        if self.max_bytes is not None and sample.size + 2 * TAR_BLOCK > self.max_bytes:
            self.pending.warnings.append(f"{self.current.tar_path.name}: sample {sample_key(position)} alone is "
                                         f"{sample.size} bytes, over --max-shard-bytes {self.max_bytes}")
        self.current.add(sample)
        self.pending.add_sample(sample)

    def skip(self, entry: dict) -> None:
        """A source item that produced no sample; recorded with the next finished shard."""
        self.pending.skipped.append(entry)

    def finish(self, next_position: int) -> list[dict]:
        """Close the last shard; returns the skips after it (in no record: a resumed run re-derives them)."""
        if self.current is not None:
            self._close(next_position)
        return self.pending.skipped

    def _full(self, next_size: int) -> bool:
        shard = self.current
        if self.max_samples is not None and shard.samples >= self.max_samples:
            return True
        # + the two zero blocks that end a tar: keep the finished file under the limit where possible
        return self.max_bytes is not None and shard.bytes_so_far + next_size + 2 * TAR_BLOCK > self.max_bytes

    def _close(self, next_position: int) -> None:
        self.pending.shards.append(self.current.finish())
        record = ShardRecord(self.pending, next_position)
        self.progress.save(self.progress_key, self.sequence, record)
        self.records.append(record)
        self.current, self.sequence = None, self.sequence + 1
        if not self.aligned:
            self.number += 1
        self.pending = Totals()


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
    positions: range | None = None,
    prefix: str | None = None,
    on_error: str = "skip",
    on_items: Callable[[int], None] = lambda n: None,
) -> Totals:
    """Encode `plan[positions]` (all of it by default) in order and pack it into `out_dir/<prefix>-NNNNNN.tar`
    shards (prefix: the split's name), resuming after the shards `progress` already records. `describe(item)`
    names an item in skip lists and errors. Returns what the split's shards (resumed ones too) add up to."""
    positions = positions if positions is not None else range(len(plan))
    prefix = prefix or split
    done = progress.finished(prefix, out_dir)
    start = done[-1].next_position if done else positions.start
    on_items(start - positions.start)
    work = [(position, plan[position]) for position in range(start, positions.stop)]
    with ShardWriter(out_dir, prefix, max_bytes=max_shard_bytes, max_samples=samples_per_shard, progress=progress,
                     progress_key=prefix, first_number=len(done), first_record=len(done)) as writer:
        # closed as soon as the loop is left, so a stop or an error ends the workers before it is reported
        with contextlib.closing(ordered_map(functools.partial(_encode_and_pack, encode), work, workers)) as results:
            for position, result in enumerate(results, start=start):
                on_items(1)
                if isinstance(result, Skip):
                    if on_error == "fail":
                        raise ConversionFailed(f"{describe(plan[position])}: {result.reason}")
                    writer.skip({"path": describe(plan[position]), "reason": result.reason})
                else:
                    writer.write(result, position)
        trailing_skips = writer.finish(positions.stop)
    return Totals.sum([*(record.totals for record in done + writer.records), Totals(skipped=trailing_skips)])


def _encode_and_pack(encode: Callable, work: tuple[int, object]) -> PackedSample | Skip:
    position, item = work
    result = encode(item)
    return result if isinstance(result, Skip) else pack_sample(sample_key(position), result)


_SHARD_FILE = re.compile(r"^\.?[A-Za-z0-9_]+(-j\d{4})?-\d{6}\.(tar|idx)(\.tmp(-\d+)?)?$")


def is_output_file(name: str) -> bool:
    """Whether a file name in OUT is one a conversion writes: a shard, an index (or a temporary one of
    them), the manifest, the run log."""
    return bool(_SHARD_FILE.match(name)) or name in ("manifest.json", "convert.json")


def remove_outputs(out_dir: Path) -> None:
    """Delete what a conversion writes (shards, indexes, manifest, progress, job records) and nothing else."""
    for p in out_dir.iterdir():
        if p.is_file() and is_output_file(p.name):
            p.unlink()
    for folder in (PROGRESS_DIR, JOBS_DIR):
        ProgressStore(out_dir / folder).remove()

