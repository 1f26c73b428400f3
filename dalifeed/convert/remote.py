"""Conversion into object storage: `shard-convert imagefolder SRC s3://bucket/prefix` (any converter).

The conversion core does not change: it writes into a local staging folder as into any OUT (same shards,
same progress records, same resume). Three things differ, all here:

- `pull_state` (before a run, under the staging folder's lock): the store is the truth. The staging
  folder's own state is dropped and the store's progress records and manifest are copied into it, so a
  fresh staging folder (another machine, a wiped /tmp) resumes as well as the old one; multipart uploads
  a killed run left unfinished are aborted.
- `StoreProgress`, the run's progress store: when a shard is finished it uploads its index and tar (in a
  background thread, at most `MAX_PENDING` shards behind, so the staging folder holds a few shards at
  most), deletes them locally, then mirrors the shard's progress record to the store. A shard counts as
  finished on resume only if the store holds both files with the manifest's sizes and sha256s; one
  already there (a kill between upload and record) is not uploaded again.
- `publish`: `convert.json`, then `manifest.json`, last: a reader never sees a partial dataset.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import s3
from ..format import MANIFEST_NAME
from .shards import PROGRESS_DIR, ProgressStore, ShardRecord, is_output_file, remove_outputs

MAX_PENDING = 2  # shards finished but not yet uploaded, beyond the one being written


def default_staging(url: str) -> Path:
    """A staging folder named after the destination, so that a re-run on this machine finds it (and its
    lock refuses a second conversion to the same place)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dalifeed-staging-{digest}"


def is_ours(name: str) -> bool:
    """An object under the destination prefix that a conversion writes."""
    return is_output_file(name) or name.startswith(f"{PROGRESS_DIR}/")


class NotEmpty(Exception):
    """The destination holds objects that no conversion wrote."""


def pull_state(url: str, staging: Path, overwrite: bool) -> None:
    """Make the staging folder's conversion state the store's (see the module docstring). With
    `overwrite`, delete what a conversion wrote under `url` instead. Raises NotEmpty when `url` holds
    other objects and no conversion state."""
    objects = s3.list_objects(url)  # the first request: a missing bucket or bad credentials stop here
    s3.abort_uploads(url)
    remove_outputs(staging)  # shards, records and manifest of an earlier run from here
    ours = sorted(name for name in objects if is_ours(name))
    if overwrite:
        s3.delete(url, ours)
        return
    state = [name for name in ours if name == MANIFEST_NAME or name.startswith(f"{PROGRESS_DIR}/")]
    foreign = sorted(set(objects) - set(ours))
    if foreign and not state:
        raise NotEmpty(f"{url}: not empty (holds {foreign[0]}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1
                                                                  else "") + ")")
    with ThreadPoolExecutor(s3.PARALLEL) as pool:
        contents = list(pool.map(lambda name: s3.get_bytes(s3.join(url, name)), state))
    for name, data in zip(state, contents):
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def publish(staging: Path, url: str) -> None:
    """Upload the run log, then the manifest: after every shard, so that its presence means complete."""
    for name in ("convert.json", MANIFEST_NAME):
        s3.put_bytes(s3.join(url, name), (staging / name).read_bytes())


class StoreProgress(ProgressStore):
    """The progress store of a conversion into `url`: see the module docstring."""

    def __init__(self, folder: Path, url: str, staging: Path):
        super().__init__(folder)
        self.url, self.staging = url, staging
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="dalifeed-upload")
        self._pending: deque[Future] = deque()

    def _progress_url(self, name: str) -> str:
        return s3.join(self.url, f"{PROGRESS_DIR}/{name}")

    def start(self, fingerprint: dict) -> None:
        super().start(fingerprint)
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
        names = [name for name in s3.list_objects(self.url) if name.startswith(f"{PROGRESS_DIR}/")]
        s3.delete(self.url, names)
