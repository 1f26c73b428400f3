"""One writer per job of a conversion into s3://: a lease object in the store, so that two machines converting
into the same URL (the same job index) are told, not left to overwrite each other's progress records.

The lease of job I of N is `PREFIX/.dalifeed-leases/job-IIII-of-NNNN` (a single job is job 0 of 1). It is
taken with a conditional put (`If-None-Match: *`: the store creates it only if absent), renewed every
`stale_s / 4` seconds by a background thread with `If-Match: <its ETag>` (so a renewal never overwrites
another holder's lease), and deleted when the run ends. A lease that is there already is taken over, with
`If-Match` on the ETag just read (of two takers one wins), only if its holder is gone:

- on the same host (and pid namespace), its pid is not alive (a killed run, re-run on that machine, takes
  over at once);
- else it was not renewed for `stale_s` seconds, by the store's clock (its Last-Modified against the Date
  of the same response: no two machines' clocks are compared).

Otherwise `LeaseHeld`: one line naming the URL and the holder (host, pid, when renewed). A holder whose lease
was taken over (it stalled longer than `stale_s`) finds out at its next renewal or upload and stops
(`LeaseLost`): never two writers silently.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from email.utils import parsedate_to_datetime

from .. import s3
from ..runtime import FolderInUse, pid_alive

LEASE_DIR = ".dalifeed-leases"
STALE_S = 60.0  # a lease not renewed for this long is taken over (renewed every STALE_S / 4)


class LeaseHeld(FolderInUse):
    """Another live run holds the lease (exit 2, as the local folder lock: nothing is wrong with the data)."""


class LeaseLost(s3.StorageError):
    """Another run took this run's lease over (this one stalled longer than the staleness limit)."""


def lease_name(index: int, count: int) -> str:
    return f"{LEASE_DIR}/job-{index:04d}-of-{count:04d}"


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class Lease:
    """This run's lease of job `index` of `count` under `url`: `acquire`, then `check` before writing, then
    `release`."""

    def __init__(self, url: str, index: int, count: int, stale_s: float = STALE_S):
        self.url, self.index, self.count, self.stale_s = url, index, count, stale_s
        self.object_url = s3.join(url, lease_name(index, count))
        self.owner = {"host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": os.getpid(),
                      "token": uuid.uuid4().hex, "started": time.time()}
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def what(self) -> str:
        return f"{self.url}" + (f" (job {self.index} of {self.count})" if self.count > 1 else "")

    def _put(self, **condition) -> str:
        bucket, key = s3.parse_s3_url(self.object_url)
        body = json.dumps({**self.owner, "renewed": time.time()}).encode()
        return s3.client().put_object(Bucket=bucket, Key=key, Body=body, **condition)["ETag"]

    def _read(self) -> tuple[dict, str, float] | None:
        """The lease in the store: (holder, ETag, seconds since it was written by the store's clock); None
        if there is none."""
        bucket, key = s3.parse_s3_url(self.object_url)
        try:
            response = s3.client().get_object(Bucket=bucket, Key=key)
        except Exception as e:
            if _status(e) == 404:
                return None
            raise s3.explain(e, self.object_url) from e
        try:
            holder = json.loads(response["Body"].read())
        except ValueError:
            holder = {}
        now = parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        return holder, response["ETag"], (now - response["LastModified"]).total_seconds()

    def acquire(self) -> None:
        """Take the lease (see the module docstring) and start renewing it; LeaseHeld if a live run holds it."""
        for _ in range(3):  # a lease deleted or taken over between our requests: look again
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except Exception as e:
                if _status(e) not in (409, 412):
                    raise s3.explain(e, self.object_url) from e
            found = self._read()
            if found is None:
                continue
            holder, etag, age = found
            if not self._gone(holder, age):
                raise LeaseHeld(f"{self.what}: another conversion is writing here: {describe(holder)}, lease "
                                f"renewed {age:.0f} s ago ({lease_name(self.index, self.count)}; taken over once "
                                f"not renewed for {self.stale_s:.0f} s)")
            try:
                self.etag = self._put(IfMatch=etag)
                break
            except Exception as e:
                if _status(e) not in (404, 409, 412):
                    raise s3.explain(e, self.object_url) from e
        else:
            raise LeaseHeld(f"{self.what}: another conversion keeps taking the lease "
                            f"{lease_name(self.index, self.count)}; run one conversion at a time")
        self._thread = threading.Thread(target=self._renew_until_released, daemon=True, name="dalifeed-lease")
        self._thread.start()

    def _gone(self, holder: dict, age: float) -> bool:
        if age >= self.stale_s:
            return True
        # containers sharing a host name may not share pids: the pid is only looked up in our own pid namespace
        same_host = all(holder.get(k) == self.owner[k] for k in ("host", "pid_namespace"))
        return same_host and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])

    def _renew_until_released(self) -> None:
        while not self._stop.wait(max(self.stale_s / 4, 0.1)):  # at most 10 PUTs a second, whatever the limit
            try:
                self.etag = self._put(IfMatch=self.etag)
            except Exception as e:
                if _status(e) in (404, 409, 412):
                    found = self._read()
                    self.lost = describe(found[0]) if found else "nobody (the lease was deleted)"
                    return
                # the store unreachable for a moment: try again at the next renewal (staleness allows 3 misses)

    def check(self) -> None:
        """Raise LeaseLost if another run took the lease over: called before every write to the store."""
        if self.lost is not None:
            raise LeaseLost(f"{self.what}: another conversion took this run's lease over ({self.lost}) after "
                            f"it was not renewed for {self.stale_s:.0f} s; stopping so as not to write beside it")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self.etag is not None:
            bucket, key = s3.parse_s3_url(self.object_url)
            try:
                s3.client().delete_object(Bucket=bucket, Key=key, IfMatch=self.etag)
            except Exception:  # taken over meanwhile, or the store gone: the lease goes stale by itself
                pass
        self.etag = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def describe(holder: dict) -> str:
    started = holder.get("started")
    since = (time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
             if isinstance(started, (int, float)) else "")
    return f"held by {holder.get('host', '?')} pid {holder.get('pid', '?')}{since}"


def _status(error: Exception) -> int | None:
    response = getattr(error, "response", None) or {}
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
