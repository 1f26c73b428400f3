"""Conversion into object storage: `shard-convert imagefolder SRC s3://bucket/prefix` (any converter).

The conversion core does not change: it writes into a local staging folder as into any OUT (same shards,
same progress records, same resume). Three things differ, all here:

- `pull_state` (before a run, under the staging folder's lock): the store is the truth. The staging
  folder's own state is dropped and the store's progress records and manifest are copied into it, so a
  fresh staging folder (another machine, a wiped /tmp) resumes as well as the old one; multipart uploads
  a killed run left unfinished are aborted.
- `StoreProgress`, the run's progress store: uploads each finished shard's index and tar in the background
  (at most `MAX_PENDING` shards behind), deletes them locally, then mirrors its progress record to the store.
- `publish`: `convert.json`, then `manifest.json`, last: a reader never sees a partial dataset.

One of N jobs (`--num-jobs`) does the same with its own progress records (`.dalifeed-progress/job-IIII/`) and
ends with its job record (`.dalifeed-jobs/job-IIII-of-NNNN.json`) instead of the manifest; `merge_in_store`
adds the records in the store up and uploads the manifest. `lease.py` keeps a second writer of the same
job (another machine) out.
"""

from __future__ import annotations

import json
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import s3
from ..format import MANIFEST_NAME, ShardManifest
from .jobs import MergeError, add_up_records
from .lease import LEASE_DIR, Lease
from .shards import JOBS_DIR, PROGRESS_DIR, ProgressStore, ShardRecord, is_output_file, remove_outputs

MAX_PENDING = 2  # shards finished but not yet uploaded, beyond the one being written


def is_ours(name: str) -> bool:
    """An object under the destination prefix that a conversion writes."""
    return is_output_file(name) or name.startswith((f"{PROGRESS_DIR}/", f"{JOBS_DIR}/", f"{LEASE_DIR}/"))


class NotEmpty(Exception):
    """The destination holds objects that no conversion wrote."""


def pull_state(url: str, staging: Path, overwrite: bool, progress: str = PROGRESS_DIR, job: bool = False) -> None:
    """Make the staging folder's conversion state the store's (see the module docstring): the manifest,
    the job records and this run's progress records (under `progress`: one job's of a --num-jobs
    conversion). With `overwrite`, delete what a conversion wrote under `url` instead (not the leases: this
    run's is among them). Raises NotEmpty when `url` holds other objects and no conversion state. One `job`
    of several leaves the multipart uploads alone (the other jobs' are running): it aborts its own when done
    (`abort_uploads_of`)."""
    objects = s3.list_objects(url)
    if not job:
        s3.abort_uploads(url)
    remove_outputs(staging)  # shards, records and manifest of an earlier run from here
    ours = sorted(name for name in objects if is_ours(name))
    if overwrite:
        s3.delete(url, [name for name in ours if not name.startswith(f"{LEASE_DIR}/")])
        return
    foreign = sorted(set(objects) - set(ours))
    if foreign and not any(name == MANIFEST_NAME or name.startswith((f"{PROGRESS_DIR}/", f"{JOBS_DIR}/"))
                           for name in ours):
        raise NotEmpty(f"{url}: not empty (holds {foreign[0]}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1
                                                                  else "") + ")")
    state = [name for name in ours if name == MANIFEST_NAME or name.startswith((f"{progress}/", f"{JOBS_DIR}/"))]
    with ThreadPoolExecutor(s3.PARALLEL) as pool:
        contents = list(pool.map(lambda name: s3.get_bytes(s3.join(url, name)), state))
    for name, data in zip(state, contents):
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def publish(staging: Path, url: str, names: tuple[str, ...] = ("convert.json", MANIFEST_NAME)) -> None:
    """Upload the run log, then the manifest (or one job's record): after every shard, so that its presence
    means complete."""
    for name in names:
        s3.put_bytes(s3.join(url, name), (staging / name).read_bytes())


def abort_uploads_of(url: str, names: set[str]) -> None:
    """Abort the unfinished multipart uploads of the objects `names` under `url`: what a killed run of one
    job left of its own shards (every upload of this run is finished by now)."""
    bucket, prefix = s3.parse_s3_url(url)
    keys = {f"{prefix}/{name}" for name in names}
    try:
        for page in s3.client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for upload in page.get("Uploads", []):
                if upload["Key"] in keys:
                    s3.client().abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    except Exception as e:
        raise s3.explain(e, url) from e


def merge_in_store(url: str) -> ShardManifest:
    """`shard-convert merge s3://...`: `core.merge` on the job records in the store, copied into a temporary
    folder (with the progress folders of jobs that started, for MergeError's "still running"); the manifest
    is uploaded last, in one PUT: a reader sees all of it or none. Idempotent: merges running at once write
    the same bytes."""
    objects = s3.list_objects(url)
    records = sorted(name for name in objects if name.startswith(f"{JOBS_DIR}/") and name.endswith(".json"))
    started = {name.split("/")[1] for name in objects if name.startswith(f"{PROGRESS_DIR}/job-")}
    with tempfile.TemporaryDirectory(prefix="dalifeed-merge-") as tmp:
        folder = Path(tmp)
        (folder / JOBS_DIR).mkdir()
        for job in started:
            (folder / PROGRESS_DIR / job).mkdir(parents=True)
        with ThreadPoolExecutor(s3.PARALLEL) as pool:
            contents = list(pool.map(lambda name: s3.get_bytes(s3.join(url, name)), records))
        for name, data in zip(records, contents):
            (folder / name).write_bytes(data)
        try:
            manifest = add_up_records(folder)
        except MergeError as e:  # name the store, not the temporary folder
            raise MergeError(str(e).replace(f"{folder}/", f"{url}/").replace(str(folder), url)) from None
        manifest.save()
        s3.put_bytes(s3.join(url, MANIFEST_NAME), (folder / MANIFEST_NAME).read_bytes())
    manifest.url = url
    return manifest


class StoreProgress(ProgressStore):
    """The progress store of a conversion into `url`: see the module docstring."""

    def __init__(self, folder: Path, url: str, staging: Path, lease: Lease | None = None):
        super().__init__(folder)
        self.url, self.staging, self.lease = url, staging, lease
        self.prefix = folder.relative_to(staging).as_posix()  # .dalifeed-progress[/job-IIII]: this run's records
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="dalifeed-upload")
        self._pending: deque[Future] = deque()

    def _progress_url(self, name: str) -> str:
        return s3.join(self.url, f"{self.prefix}/{name}")

    def check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def start(self, fingerprint: dict) -> None:
        super().start(fingerprint)
        self.check_lease()
        s3.put_bytes(self._progress_url("fingerprint.json"), json.dumps(fingerprint, indent=2).encode())

    def save(self, split: str, sequence: int, record: ShardRecord) -> None:
        super().save(split, sequence, record)
        self._pending.append(self._uploader.submit(self._upload, split, sequence, record))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft().result()  # an upload's error is raised here, in the main thread

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def _upload(self, split: str, sequence: int, record: ShardRecord) -> None:
        self.check_lease()
        shard = record.shard
        for name, sha256 in ((shard.index, shard.index_sha256), (shard.path, shard.sha256)):  # the tar last
            path, url = self.staging / name, s3.join(self.url, name)
            if s3.head(url) != s3.ObjectHead(path.stat().st_size, sha256):
                s3.upload_file(path, url, sha256)
            path.unlink()
        body = json.dumps(record.to_json(), indent=2).encode()
        s3.put_bytes(self._progress_url(f"{split}-{sequence:06d}.json"), body)

    def finished(self, split: str, out_dir: Path) -> list[ShardRecord]:
        """The consecutive recorded shards whose index and tar the store holds with the recorded size and
        sha256 (a HEAD each, in parallel)."""
        records = self.records(split)
        urls = [s3.join(self.url, name) for r in records for name in (r.shard.index, r.shard.path)]
        heads = s3.head_many(urls)
        finished = []
        for i, record in enumerate(records):
            index, tar = heads[2 * i], heads[2 * i + 1]
            if not (index is not None and tar == s3.ObjectHead(record.shard.bytes, record.shard.sha256)
                    and record.shard.index_sha256 in (None, index.sha256)):
                break
            finished.append(record)
        return finished

    def remove(self) -> None:
        self.flush()
        super().remove()
        names = [name for name in s3.list_objects(self.url) if name.startswith(f"{self.prefix}/")]
        s3.delete(self.url, names)
