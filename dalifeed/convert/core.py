"""The conversion every converter shares. A converter (ImageFolder, COCO) turns its source into a `Plan`:
per split, the ordered items, an `encode` function for one item, the classes, a fingerprint of source and
options, and what it already knows is skipped. `convert` does the rest, the same for all:

- holds OUT's lock, decides between a fresh run, a resume (after Ctrl-C, kill -9, a full disk) and
  "nothing to do", and refuses a folder made from other input, naming what differs;
- encodes in worker processes and writes shards with `write_split` (deterministic, atomic, resumable);
- writes `manifest.json` last, or, for one of N jobs (`--num-jobs N --job-index I`), a job record that
  `merge` later combines into the manifest (`jobs.py`, docs/scaling.md); both are added up by `jobs.add_up`.

For an s3:// OUT the core writes into a local staging folder (`ShardOptions.folder`, options.py) as into any
OUT and `remote.py` uploads what it finishes. The imports run one way: options <- jobs <- remote <- core.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic import write_json_atomic
from ..format import FORMAT_VERSION, MANIFEST_NAME, ShardManifest, SplitInfo
from ..runtime import LOCK_NAME, DiskFull, FolderInUse, folder_lock, free_bytes, mib, write_remedy
from ..s3 import is_s3_url
from . import remote
from .jobs import (
    MergeError,
    Part,
    add_up,
    add_up_records,
    job_positions,
    job_record_path,
    shard_prefix,
    write_job_record,
)
from .lease import Lease, LeaseHeld
from .options import ShardOptions, UsageError, is_conversion_state
from .shards import JOBS_DIR, PROGRESS_DIR, ProgressStore, Totals, describe_difference, remove_outputs, write_split


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
    """What a conversion did, as `shard-convert` prints it: the `summary` attribute of the manifest a
    converter returns.

    Attributes:
        samples: Samples in the shards, all splits.
        shards: Shard files (tars), all splits.
        bytes: The shards' total size in bytes.
        skipped: Source entries left out (undecodable, not an image, unreadable), each listed with its reason
            in the manifest's `skipped`.
        reencoded: Images re-encoded to JPEG rather than copied byte for byte.
        seconds: Wall-clock seconds this call took.
        status: `"fresh"` (converted from the start), `"resume"` (an interrupted conversion continued),
            `"done"` (the folder already held this conversion: nothing written) or `"job"` (one part of a
            conversion split into jobs, waiting for the others).
    """

    samples: int
    shards: int
    bytes: int
    skipped: int
    reencoded: int
    seconds: float
    status: str

    @property
    def images_per_s(self) -> float:
        """Samples per second of wall-clock time (0.0 when no time passed)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def convert(plan: Plan, opts: ShardOptions, command: str) -> ShardManifest:
    """Write `plan` into OUT (`opts.folder`); resumes an interrupted run. Returns the manifest with `summary`
    attached (for one of several jobs, the manifest of this job's part, not saved: see `merge`)."""
    started = time.perf_counter()
    # the format version too: a run of another version must not resume into (or call done) a folder of this one
    fingerprint = {**plan.fingerprint, "format_version": FORMAT_VERSION}
    if opts.jobs:
        fingerprint["num_jobs"] = opts.num_jobs
    make_output_folder(opts)
    # an s3:// OUT has no lock of its own: the lease in the store keeps a second machine out (lease.py)
    lease = Lease(opts.remote, opts.job_index, opts.num_jobs, opts.lease_stale_s) if opts.remote else None
    with folder_lock(opts.folder, command, name=job_lock_name(opts)), take_lease(lease, opts):
        status = prepare_remote_output(opts, fingerprint) if opts.remote else prepare_output(opts, fingerprint)
        if status == "done":
            manifest = load_done(opts)
        else:
            try:
                manifest = write_all(plan, opts, fingerprint, lease)
            except DiskFull as e:
                written = sum(p.stat().st_size for p in opts.folder.glob("*.tar"))
                raise DiskFull(f"{e} ({mib(free_bytes(opts.folder))} free; the images not converted yet need about "
                               f"{mib(max(0, plan.source_bytes - written))} more): {write_remedy(e)}, then run the "
                               f"same command again to resume") from e
    summary = summarize(manifest, time.perf_counter() - started, status if not opts.jobs or status == "done" else "job")
    manifest.summary = summary
    if opts.remote:
        manifest.url = opts.remote
        if opts.temporary_staging:  # it holds only the manifest and the run log now
            shutil.rmtree(opts.folder, ignore_errors=True)
    if opts.jobs and status != "done":
        merged = merge_if_complete(opts.remote or opts.folder)
        if merged is not None:  # this was the last job to finish
            merged.summary = summarize(merged, summary.seconds, "merged")
            return merged
    return manifest


def merge(out: Path | str) -> ShardManifest:
    """Combine the records of every job of a conversion into OUT's manifest.json, checking that all N are
    there and were made with the same options and plan. Idempotent; holds OUT's lock while it writes. OUT
    may be s3://bucket/prefix (`remote.merge_in_store`)."""
    if is_s3_url(out):
        return remote.merge_in_store(str(out))
    out = Path(out)
    manifest = add_up_records(out)
    with folder_lock(out, "shard-convert merge"):
        manifest.save()
    return manifest


def merge_if_complete(out: Path | str) -> ShardManifest | None:
    """After a job: merge when every job's record is there (the last job to finish does it), else None."""
    try:
        return merge(out)
    except (MergeError, FolderInUse):
        return None


@contextmanager
def take_lease(lease: Lease | None, opts: ShardOptions):
    """Hold `lease` (None: a local OUT, nothing to hold) for the block. A refusal leaves no default staging
    folder behind (this run holds its lock: no other run on this host uses it)."""
    if lease is None:
        yield
        return
    try:
        lease.acquire()
    except LeaseHeld:
        if opts.temporary_staging:
            shutil.rmtree(opts.folder, ignore_errors=True)
        raise
    try:
        yield
    finally:
        lease.release()


def make_output_folder(opts: ShardOptions) -> None:
    """Create OUT (the local one, or the staging folder of an s3:// OUT), refusing in one line a place no
    folder can be made: under a file, in a missing or read-only location."""
    try:
        opts.folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        shown = f": {e.filename}" if e.filename and str(e.filename) != str(opts.folder) else ""
        raise UsageError(f"{opts.folder}: cannot create the output folder ({e.strerror or e}{shown})") from None


def prepare_remote_output(opts: ShardOptions, fingerprint: dict) -> str:
    """`prepare_output` for an s3:// OUT, after copying the store's state into the staging folder. A refusal
    leaves no default staging folder behind (it would hold nothing of use)."""
    try:
        try:
            progress = progress_store(opts).dir.relative_to(opts.folder).as_posix()
            remote.pull_state(opts.remote, opts.folder, opts.overwrite, progress, job=opts.jobs)
        except remote.NotEmpty as e:
            raise UsageError(f"{e}; use --overwrite to replace it or choose another OUT") from None
        return prepare_output(opts, fingerprint)
    except UsageError:
        if opts.temporary_staging:
            shutil.rmtree(opts.folder, ignore_errors=True)
        raise


def job_lock_name(opts: ShardOptions) -> str:
    return f".dalifeed-job-{opts.job_index:04d}.lock" if opts.jobs else LOCK_NAME


def progress_store(opts: ShardOptions, lease: Lease | None = None) -> ProgressStore:
    folder = opts.folder / PROGRESS_DIR
    folder = folder / f"job-{opts.job_index:04d}" if opts.jobs else folder
    if opts.remote:
        return remote.StoreProgress(folder, opts.remote, opts.folder, lease)
    return ProgressStore(folder)


def prepare_output(opts: ShardOptions, fingerprint: dict) -> str:
    """Decide what to do with OUT (locked by this run): 'fresh', 'resume' or 'done'. Refuse a folder made
    from other input or options, saying what differs."""
    out, store = opts.folder, progress_store(opts)
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
    if any(not is_conversion_state(p.name) for p in out.iterdir()) or (opts.remote and existing is not None):
        why = f"made with other input: {describe_difference(existing, fingerprint)}" if existing else "not empty"
        raise UsageError(f"{opts.location}: output folder {why}; use --overwrite to replace it or choose another OUT")
    return "fresh"


def _read_fingerprint(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def write_all(plan: Plan, opts: ShardOptions, fingerprint: dict, lease: Lease | None = None) -> ShardManifest:
    """Encode and write every split's share of this run; then the manifest, or this job's record."""
    store = progress_store(opts, lease)
    store.start(fingerprint)
    ranges = {split: job_positions(len(items), opts) for split, items in plan.splits.items()}
    part = Part({}, plan_share(plan, opts))
    from tqdm import tqdm  # here: at the top it would slow every shard-convert start, index and verify's too

    bar = tqdm(total=sum(len(r) for r in ranges.values()) + len(part.plan.skipped), unit="img", desc="shard-convert",
               disable=not opts.progress, dynamic_ncols=True, mininterval=0.5)
    with bar:
        for split, items in plan.splits.items():
            bar.set_postfix_str(split)
            part.splits[split] = write_split(
                opts.folder, split, items, plan.encode, describe=plan.describe, workers=opts.workers,
                max_shard_bytes=opts.max_shard_bytes, samples_per_shard=opts.samples_per_shard, progress=store,
                positions=ranges[split], prefix=shard_prefix(split, opts), on_error=opts.on_error,
                on_items=bar.update,
            )
            store.flush()  # every shard of the split uploaded (s3:// OUT) before the next split starts workers
        bar.update(len(part.plan.skipped))

    extra = {**plan.extra, "fingerprint": fingerprint}
    if "source" in plan.listings:
        extra["source_listing"] = plan.listings["source"]
    template = ShardManifest(
        root=opts.folder, kind=plan.kind, source=plan.source, options=fingerprint["options"], classes=plan.classes,
        splits={split: SplitInfo(listing=plan.listings.get(split)) for split in plan.splits}, found=plan.found,
        extra=extra,
    )
    manifest = add_up(template, [part])  # a single job is the one part of its conversion
    summary = summarize(manifest, 0.0, "fresh")
    if lease is not None:
        lease.check()  # the last write: the job record or the manifest
    if opts.jobs:
        write_job_record(opts, manifest, part, asdict(summary))
        if opts.remote:  # after every shard's upload (flushed above)
            remote.abort_uploads_of(opts.remote, {name for info in manifest.splits.values() for shard in info.shards
                                                  for name in (shard.path, shard.index)})
            record = job_record_path(opts.folder, opts.job_index, opts.num_jobs)
            remote.publish(opts.folder, opts.remote, (record.relative_to(opts.folder).as_posix(),))
    else:
        write_json_atomic(opts.folder / "convert.json", {"config": opts.to_json(), "summary": asdict(summary)})
        manifest.save()  # last: its presence means the folder is complete
        if opts.remote:
            remote.publish(opts.folder, opts.remote)  # after every shard's upload (flushed above), manifest last
    store.remove()
    return manifest


def plan_share(plan: Plan, opts: ShardOptions) -> Totals:
    """What this run accounts for of what the plan found before encoding (files skipped while listing, its
    warnings and tallies): all of it in job 0 (or a single job), nothing in the others."""
    if opts.job_index != 0:
        return Totals()
    return Totals(skipped=list(plan.skipped), warnings=list(plan.warnings), counts=dict(plan.counts))


def skip_reasons(skipped: list[dict]) -> dict[str, int]:
    """How many were skipped for each kind of reason (the text before its first colon), by reason."""
    counts: dict[str, int] = {}
    for entry in skipped:
        reason = entry["reason"].split(":")[0]
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def load_done(opts: ShardOptions) -> ShardManifest:
    if not opts.jobs:
        return ShardManifest.load(opts.folder)
    doc = json.loads(job_record_path(opts.folder, opts.job_index, opts.num_jobs).read_text())
    return ShardManifest.from_json(opts.folder, doc)


def summarize(manifest: ShardManifest, seconds: float, status: str) -> ConvertSummary:
    return ConvertSummary(
        samples=sum(s.samples for s in manifest.splits.values()),
        shards=sum(len(s.shards) for s in manifest.splits.values()),
        bytes=sum(s.bytes for s in manifest.splits.values()),
        skipped=len(manifest.skipped), reencoded=manifest.reencoded.get("count", 0),
        seconds=seconds, status=status,
    )
