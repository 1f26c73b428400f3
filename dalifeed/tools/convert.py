"""The conversion every converter shares. A converter (ImageFolder, COCO) turns its source into a `Plan`:
per split, the ordered items, an `encode` function for one item, the classes, a fingerprint of source and
options, and what it already knows is skipped. `convert` does the rest, the same for all:

- holds OUT's lock, decides between a fresh run, a resume (after Ctrl-C, kill -9, a full disk) and
  "nothing to do", and refuses a folder made from other input, naming what differs;
- encodes in worker processes and writes shards with `write_split` (deterministic, atomic, resumable);
- writes `manifest.json` last, or, for one of N jobs (`--num-jobs N --job-index I`), a job record that
  `merge` later combines into the manifest (docs/scaling.md).

Jobs split the same plan: with `--samples-per-shard` alone, shard k holds plan positions [kS, (k+1)S) and
job I writes a contiguous range of shard numbers, so the merged folder is byte-identical to a single-job
conversion; with byte-sized shards, job I converts a contiguous range of positions into shards named
`<split>-jIIII-NNNNNN`, holding the same samples as a single job would.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..atomic import write_json_atomic
from ..format import FORMAT_VERSION, MANIFEST_NAME, ShardManifest, SplitInfo
from ..runtime import LOCK_NAME, DiskFull, FolderInUse, folder_lock, free_bytes, mib, usable_cores
from .images import DEFAULT_MAX_PIXELS
from ..s3 import StorageError, is_s3_url, parse_s3_url
from . import remote
from .shards import JOBS_DIR, PROGRESS_DIR, ProgressStore, is_output_file, remove_outputs, write_split

DEFAULT_MAX_SHARD_BYTES = 256 * 2**20


class UsageError(Exception):
    """Bad input or options: the CLI prints the message in one line and exits 2."""


@dataclass(frozen=True)
class SourceStat:
    """What listing a source entry tells: its size and mtime (for the fingerprint and the listing) and, for
    an entry no image can be read from, why: the skip reason it gets."""

    size: int
    mtime_ns: int
    problem: str | None = None


_FILE_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


def stat_source(path: Path) -> SourceStat:
    """Stat a source entry, following symlinks, without ever raising: a broken symlink, a symlink loop, an
    entry that cannot be stat-ed and anything that is not a regular file (reading a FIFO would block the
    conversion forever) come back with a `problem`, so that each is one skipped file, not a failed run."""
    try:
        st = os.stat(path)
    except OSError as e:
        try:
            link = os.lstat(path)
        except OSError:
            return SourceStat(0, 0, f"unreadable: {e.strerror or e}")
        if not stat.S_ISLNK(link.st_mode):
            return SourceStat(0, link.st_mtime_ns, f"unreadable: {e.strerror or e}")
        target = os.readlink(path)
        if e.errno == errno.ELOOP:
            return SourceStat(0, link.st_mtime_ns, f"unreadable: symlink loop (links to {target})")
        return SourceStat(0, link.st_mtime_ns, f"unreadable: broken symlink to {target} ({e.strerror})")
    if not stat.S_ISREG(st.st_mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
        return SourceStat(0, st.st_mtime_ns, f"not a regular file: {kind}")
    return SourceStat(st.st_size, st.st_mtime_ns)


@dataclass(kw_only=True)
class ShardOptions:
    """The options every converter has: where, how shards are cut and images encoded, how many workers, and
    which of N jobs this run is."""

    out: Path
    seed: int = 0
    max_shard_bytes: int | None = None  # None: 256 MiB, unless samples_per_shard alone is given
    samples_per_shard: int | None = None
    jpeg_quality: int = 95
    max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    workers: int = field(default_factory=usable_cores)  # affinity, cgroup quota, Slurm: not the host's CPUs
    on_error: str = "skip"
    overwrite: bool = False
    progress: bool = True
    num_jobs: int = 1
    job_index: int = 0
    staging: Path | None = None  # with an s3:// OUT: the local folder shards wait in until uploaded
    remote: str | None = None  # set from an s3:// OUT, whose staging folder `out` then is (tools/remote.py)

    def __post_init__(self) -> None:
        self._temporary_staging = False
        if is_s3_url(self.out):  # the core writes into a local staging folder; StoreProgress uploads
            self.remote, self._temporary_staging = str(self.out).rstrip("/"), self.staging is None
            self.staging = Path(self.staging) if self.staging is not None else remote.default_staging(self.remote)
            self.out = self.staging
        self.out = Path(self.out)
        # One limit given: that one. Both: a shard ends at whichever it reaches first. Neither: 256 MiB.
        if self.max_shard_bytes is None and self.samples_per_shard is None:
            self.max_shard_bytes = DEFAULT_MAX_SHARD_BYTES

    def validate_shard_options(self) -> None:
        """Check every option up front, naming the bad value."""
        checks = [
            (self.samples_per_shard is None or self.samples_per_shard >= 1,
             f"--samples-per-shard must be >= 1, got {self.samples_per_shard}"),
            (self.max_shard_bytes is None or self.max_shard_bytes >= 4096,
             f"--max-shard-bytes must be >= 4096, got {self.max_shard_bytes}"),
            (1 <= self.jpeg_quality <= 100, f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}"),
            (self.max_side is None or self.max_side >= 8, f"--max-side must be >= 8, got {self.max_side}"),
            (self.max_pixels >= 1, f"--max-pixels must be >= 1, got {self.max_pixels}"),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
            (self.on_error in ("skip", "fail"), f"--on-error must be 'skip' or 'fail', got {self.on_error!r}"),
            (self.num_jobs >= 1, f"--num-jobs must be >= 1, got {self.num_jobs}"),
            (0 <= self.job_index < self.num_jobs,
             f"--job-index must be in 0..{self.num_jobs - 1} (--num-jobs {self.num_jobs}), got {self.job_index}"),
            (not (self.overwrite and self.num_jobs > 1),
             "--overwrite with --num-jobs would delete other jobs' shards: empty OUT first instead"),
            (self.staging is None or self.remote is not None, "--staging applies only to an s3://bucket/prefix OUT"),
            (self.remote is None or not self.jobs,
             "--num-jobs with an s3:// OUT is not supported yet: run one job, or convert to a shared folder"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        if self.remote is not None:
            try:
                parse_s3_url(self.remote)
            except StorageError as e:
                raise UsageError(str(e)) from None
            stray = [p.name for p in self.out.iterdir() if not (_ours(p.name) or is_output_file(p.name))] \
                if self.out.is_dir() else []
            if stray:
                raise UsageError(f"--staging {self.out}: holds other files ({stray[0]}); give an empty or new folder")
        if self.out.exists() and not self.out.is_dir():
            raise UsageError(f"{self.out}: output exists and is not a folder")

    def shard_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"seed": self.seed, "jpeg_quality": self.jpeg_quality, "max_side": self.max_side,
                "max_pixels": self.max_pixels, "samples_per_shard": self.samples_per_shard,
                "max_shard_bytes": self.max_shard_bytes}

    def to_json(self) -> dict:
        def plain(value):
            if isinstance(value, Path):
                return str(value)
            return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value
        return {k: plain(v) for k, v in asdict(self).items()}

    @property
    def jobs(self) -> bool:
        return self.num_jobs > 1

    @property
    def location(self) -> str:
        """Where the shards go, for messages: OUT, or its s3:// URL."""
        return self.remote or str(self.out)


@dataclass
class Plan:
    """A converter's whole job, before any image is read."""

    kind: str  # manifest "kind": imagefolder | coco
    source: str  # what it was made from, for people (an absolute path, or several)
    splits: dict[str, list]  # split -> items in the order they are written (shuffled with the seed)
    classes: list[str]
    encode: Callable  # item -> Sample | Skip, run in worker processes (picklable)
    describe: Callable  # item -> the name it has in skip lists and errors
    fingerprint: dict  # decides resume vs refuse: source, options, every input file
    listings: dict = field(default_factory=dict)  # split (and "source") -> listing_digest of its files
    skipped: list[dict] = field(default_factory=list)  # found but never encoded, with the reason
    found: int = 0  # what the accounting adds up to: converted + skipped
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # kind-specific manifest fields (COCO categories, ...)
    counts: dict[str, int] = field(default_factory=dict)  # kind-specific tallies known before encoding
    source_bytes: int = 0


@dataclass
class ConvertSummary:
    samples: int
    shards: int
    bytes: int
    skipped: int
    reencoded: int
    seconds: float
    status: str  # fresh | resume | done | job (a part, waiting for merge)

    @property
    def images_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def convert(plan: Plan, opts: ShardOptions, command: str) -> ShardManifest:
    """Write `plan` into `opts.out`; resumes an interrupted run. Returns the manifest with `summary`
    attached (for one of several jobs, the manifest of this job's part, not saved: see `merge`)."""
    started = time.perf_counter()
    # the format version too: a run of another version must not resume into (or call done) a folder of this one
    fingerprint = {**plan.fingerprint, "format_version": FORMAT_VERSION}
    if opts.jobs:
        fingerprint["num_jobs"] = opts.num_jobs
    make_output_folder(opts)
    with folder_lock(opts.out, command, name=job_lock_name(opts)):
        status = prepare_remote_output(opts, fingerprint) if opts.remote else prepare_output(opts, fingerprint)
        if status == "done":
            manifest = load_done(opts)
        else:
            try:
                manifest = write_all(plan, opts, fingerprint)
            except DiskFull as e:
                written = sum(p.stat().st_size for p in opts.out.glob("*.tar"))
                raise DiskFull(f"{e} ({mib(free_bytes(opts.out))} free; the images not converted yet need about "
                               f"{mib(max(0, plan.source_bytes - written))} more): free space, then run the same "
                               f"command again to resume") from e
    summary = summarize(manifest, time.perf_counter() - started, status if not opts.jobs or status == "done" else "job")
    manifest.summary = summary
    if opts.remote:
        manifest.url = opts.remote
        if opts._temporary_staging:  # it holds only the manifest and the run log now
            shutil.rmtree(opts.out, ignore_errors=True)
    if opts.jobs and status != "done":
        merged = merge_if_complete(opts.out)
        if merged is not None:  # this was the last job to finish
            merged.summary = summarize(merged, summary.seconds, "merged")
            return merged
    return manifest


def make_output_folder(opts: ShardOptions) -> None:
    """Create OUT (the local one, or the staging folder of an s3:// OUT), refusing in one line a place no
    folder can be made: under a file, in a missing or read-only location."""
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{opts.out}: cannot create the output folder ({e.strerror or e}"
                         f"{f': {e.filename}' if e.filename and str(e.filename) != str(opts.out) else ''})") from None


def prepare_remote_output(opts: ShardOptions, fingerprint: dict) -> str:
    """`prepare_output` for an s3:// OUT, after copying the store's state into the staging folder. A refusal
    leaves no default staging folder behind (it would hold nothing of use)."""
    try:
        try:
            remote.pull_state(opts.remote, opts.out, opts.overwrite)
        except remote.NotEmpty as e:
            raise UsageError(f"{e}; use --overwrite to replace it or choose another OUT") from None
        return prepare_output(opts, fingerprint)
    except UsageError:
        if opts._temporary_staging:
            shutil.rmtree(opts.out, ignore_errors=True)
        raise


def job_lock_name(opts: ShardOptions) -> str:
    return f".dalifeed-job-{opts.job_index:04d}.lock" if opts.jobs else LOCK_NAME


def progress_store(opts: ShardOptions) -> ProgressStore:
    folder = opts.out / PROGRESS_DIR
    if opts.remote:
        return remote.StoreProgress(folder, opts.remote, opts.out)
    return ProgressStore(folder / f"job-{opts.job_index:04d}" if opts.jobs else folder)


def job_record_path(out: Path, index: int, count: int) -> Path:
    return out / JOBS_DIR / f"job-{index:04d}-of-{count:04d}.json"


def prepare_output(opts: ShardOptions, fingerprint: dict) -> str:
    """Decide what to do with OUT (locked by this run): 'fresh', 'resume' or 'done'. Refuse a folder made
    from other input or options, saying what differs."""
    out, store = opts.out, progress_store(opts)
    done_path = job_record_path(out, opts.job_index, opts.num_jobs) if opts.jobs else out / MANIFEST_NAME
    existing = store.fingerprint() if store.exists() else _read_fingerprint(done_path)
    if opts.overwrite:
        remove_outputs(out)
        return "fresh"
    if existing == fingerprint:
        return "done" if done_path.is_file() and not store.exists() else "resume"
    if opts.jobs:
        other = _read_fingerprint(out / MANIFEST_NAME) or next(
            (f for f in map(_read_fingerprint, sorted((out / JOBS_DIR).glob("job-*.json"))) if f), None)
        if existing is not None or (other is not None and other != fingerprint):
            raise UsageError(f"{out}: made with other input: {describe_difference(existing or other, fingerprint)}; "
                             f"every job of a conversion must run the same command (but --job-index)")
        return "fresh"
    # in a store, records of another run may exist without a shard in the staging folder
    if any(not _ours(p.name) for p in out.iterdir()) or (opts.remote and existing is not None):
        why = f"made with other input: {describe_difference(existing, fingerprint)}" if existing else "not empty"
        raise UsageError(f"{opts.location}: output folder {why}; use --overwrite to replace it or choose another OUT")
    return "fresh"


def _ours(name: str) -> bool:
    """Files a conversion leaves in OUT before it has written anything: state, locks, an error log."""
    return name in (PROGRESS_DIR, JOBS_DIR, LOCK_NAME, "convert-error.log") or name.startswith(".dalifeed-job-")


def _read_fingerprint(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


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


def job_positions(n: int, opts: ShardOptions) -> range:
    """The plan positions of a split of `n` items that job `opts.job_index` of `opts.num_jobs` converts."""
    index, count = opts.job_index, opts.num_jobs
    if opts.max_shard_bytes is None:  # whole shards: a contiguous range of shard numbers
        shards = -(-n // opts.samples_per_shard)
        first, last = shards * index // count, shards * (index + 1) // count
        return range(min(n, first * opts.samples_per_shard), min(n, last * opts.samples_per_shard))
    return range(n * index // count, n * (index + 1) // count)


def write_all(plan: Plan, opts: ShardOptions, fingerprint: dict) -> ShardManifest:
    """Encode and write every split's share of this run; then the manifest, or this job's record."""
    store = progress_store(opts)
    store.start(fingerprint)
    ranges = {split: job_positions(len(items), opts) if opts.jobs else range(len(items))
              for split, items in plan.splits.items()}
    accounted_here = plan.skipped if opts.job_index == 0 else []  # job 0 accounts for the pre-skipped
    splits, skipped, reencoded, warnings = {}, [], {}, list(plan.warnings) if opts.job_index == 0 else []
    counts = dict(plan.counts) if opts.job_index == 0 else {}
    by_split = {}  # this job's skips and warnings per split, for `merge` to list them in a single job's order
    total = sum(len(r) for r in ranges.values()) + len(accounted_here)
    bar = tqdm(total=total, unit="img", desc="shard-convert", disable=not opts.progress, dynamic_ncols=True,
               mininterval=0.5)
    with bar:
        for split, items in plan.splits.items():
            bar.set_postfix_str(split)
            prefix = f"{split}-j{opts.job_index:04d}" if opts.jobs and opts.max_shard_bytes is not None else split
            result = write_split(
                opts.out, split, items, plan.encode, describe=plan.describe, workers=opts.workers,
                max_shard_bytes=opts.max_shard_bytes, samples_per_shard=opts.samples_per_shard, progress=store,
                positions=ranges[split], prefix=prefix, on_error=opts.on_error, on_items=bar.update,
            )
            store.flush()  # every shard of the split uploaded (s3:// OUT) before the next split forks workers
            class_counts = [result.classes.get(str(label), 0) for label in range(len(plan.classes))]
            splits[split] = SplitInfo(result.shards, class_counts, plan.listings.get(split))
            skipped += result.skipped
            warnings += result.warnings
            by_split[split] = {"skipped": result.skipped, "warnings": result.warnings}
            for reason, n in result.reencoded.items():
                reencoded[reason] = reencoded.get(reason, 0) + n
            for name, n in result.counts.items():
                counts[name] = counts.get(name, 0) + n
        skipped += accounted_here
        bar.update(len(accounted_here))

    extra = {**plan.extra, "fingerprint": fingerprint}
    if counts:
        extra["counts"] = dict(sorted(counts.items()))
    if "source" in plan.listings:
        extra["source_listing"] = plan.listings["source"]
    manifest = ShardManifest(
        root=opts.out, kind=plan.kind, source=plan.source, options=fingerprint["options"], classes=plan.classes,
        splits=splits, skipped=skipped, found=plan.found,
        reencoded={"count": sum(reencoded.values()), "by_reason": dict(sorted(reencoded.items()))},
        warnings=warnings, extra=extra,
    )
    summary = summarize(manifest, 0.0, "fresh")
    if opts.jobs:
        job = job_record_path(opts.out, opts.job_index, opts.num_jobs)
        job.parent.mkdir(exist_ok=True)
        plan_part = {"skipped": accounted_here, "warnings": list(plan.warnings) if opts.job_index == 0 else []}
        write_json_atomic(job, {**manifest.to_json(), "job": {"index": opts.job_index, "count": opts.num_jobs,
                                                               "splits": by_split, "plan": plan_part},
                                "summary": asdict(summary)})
    else:
        write_json_atomic(opts.out / "convert.json", {"config": opts.to_json(), "summary": asdict(summary)})
        manifest.save()  # last: its presence means the folder is complete
        if opts.remote:
            remote.publish(opts.out, opts.remote)  # after every shard's upload (flushed above), manifest last
    store.remove()
    return manifest


def skip_reasons(skipped: list[dict]) -> dict[str, int]:
    """How many were skipped for each kind of reason (the text before its first colon), by reason."""
    counts: dict[str, int] = {}
    for entry in skipped:
        reason = entry["reason"].split(":")[0]
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def load_done(opts: ShardOptions) -> ShardManifest:
    if not opts.jobs:
        return ShardManifest.load(opts.out)
    doc = json.loads(job_record_path(opts.out, opts.job_index, opts.num_jobs).read_text())
    return ShardManifest.from_json(opts.out, doc)


def summarize(manifest: ShardManifest, seconds: float, status: str) -> ConvertSummary:
    return ConvertSummary(
        samples=sum(s.samples for s in manifest.splits.values()),
        shards=sum(len(s.shards) for s in manifest.splits.values()),
        bytes=sum(s.bytes for s in manifest.splits.values()),
        skipped=len(manifest.skipped), reencoded=manifest.reencoded.get("count", 0),
        seconds=seconds, status=status,
    )


# ----------------------------------------------------------------------------------------------------
# jobs -> one manifest


class MergeError(Exception):
    """A job is missing or was run differently: one line naming it."""


def merge(out: Path) -> ShardManifest:
    """Combine the records of every job of a conversion into OUT's manifest.json, checking that all N are
    there and were made with the same options and plan. Idempotent; holds OUT's lock while it writes."""
    out = Path(out)
    records = sorted((out / JOBS_DIR).glob("job-*-of-*.json"))
    if not records:
        raise MergeError(f"{out}: no job records in {out / JOBS_DIR} (is this the OUT of a --num-jobs conversion?)")
    docs = [read_job_record(p) for p in records]
    count = docs[0]["job"]["count"]
    found = {doc["job"]["index"]: doc for doc in docs if doc["job"]["count"] == count}
    strays = [p.name for p, doc in zip(records, docs) if doc["job"]["count"] != count]
    if strays:
        raise MergeError(f"{out}: job records of different --num-jobs ({', '.join(strays)} against {count})")
    missing = [i for i in range(count) if i not in found]
    if missing:
        running = [i for i in missing if (out / PROGRESS_DIR / f"job-{i:04d}").is_dir()]
        state = f" ({len(running)} of them started: still running or interrupted)" if running else ""
        raise MergeError(f"{out}: job {missing[0]} of {count} has not finished (no {job_record_path(out, missing[0], count).name})"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + state)
    reference = found[0]["fingerprint"]
    for index in range(count):
        if found[index]["fingerprint"] != reference:
            raise MergeError(f"{out}: job {index} was made with other input than job 0: "
                             f"{describe_difference(reference, found[index]['fingerprint'])}")
    parts = [ShardManifest.from_json(out, found[i]) for i in range(count)]
    first = parts[0]
    splits = {}
    for split in first.splits:
        shards = [shard for part in parts for shard in part.splits[split].shards]
        counts = [sum(part.splits[split].class_counts[c] for part in parts) for c in range(len(first.classes))]
        splits[split] = SplitInfo(shards, counts, first.splits[split].listing)
    reasons: dict[str, int] = {}
    for part in parts:
        for reason, n in part.reencoded["by_reason"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    # the fingerprint of the whole conversion, as a single job would have written it: the folder is the same
    whole = {k: v for k, v in reference.items() if k != "num_jobs"}
    counts: dict[str, int] = {}
    for part in parts:
        for name, n in part.extra.get("counts", {}).items():
            counts[name] = counts.get(name, 0) + n
    extra = {**first.extra, "fingerprint": whole}
    if counts:
        extra["counts"] = dict(sorted(counts.items()))
    skipped, warnings = in_single_job_order([found[i] for i in range(count)], list(first.splits))
    manifest = ShardManifest(
        root=out, kind=first.kind, source=first.source, options=first.options, classes=first.classes,
        splits=splits, skipped=skipped, found=first.found,
        reencoded={"count": sum(reasons.values()), "by_reason": dict(sorted(reasons.items()))},
        warnings=warnings, extra=extra,
    )
    with folder_lock(out, "shard-convert merge"):
        manifest.save()
    return manifest


def in_single_job_order(records: list[dict], splits: list[str]) -> tuple[list[dict], list[str]]:
    """The jobs' skipped files and warnings in the order a single job lists them: the plan's warnings, then
    split by split (within a split, job by job: plan order), then the files the plan skipped before encoding.
    Concatenating whole records instead puts job 0's val skips and strays before job 1's train skips."""
    if any("splits" not in record["job"] for record in records):  # a record of an older version: job order
        return [e for r in records for e in r["skipped"]], [w for r in records for w in r["warnings"]]
    parts = [record["job"]["splits"][split] for split in splits for record in records]
    plan = records[0]["job"]["plan"]  # job 0 accounts for what the plan itself skipped or warned about
    return ([e for part in parts for e in part["skipped"]] + plan["skipped"],
            plan["warnings"] + [w for part in parts for w in part["warnings"]])


def read_job_record(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc.get("job", {}).get("count"), int) or not isinstance(doc["job"].get("index"), int):
            raise ValueError("no job index and count")
    except (OSError, ValueError, AttributeError, KeyError) as e:
        raise MergeError(f"{path}: unreadable job record ({e}); run that job again") from None
    return doc


def merge_if_complete(out: Path) -> ShardManifest | None:
    """After a job: merge when every job's record is there (the last job to finish does it), else None."""
    try:
        return merge(out)
    except (MergeError, FolderInUse):
        return None
