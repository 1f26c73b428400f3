"""The node's shard cache: the tars of a shard folder in a store (s3://), fetched whole (one GET each) into a
local folder shared by the ranks of a node, bounded in size, and handed to DALI as local files.

Why whole tars before the pipeline is built: DALI 2.4's webdataset reader opens (memory-maps) every tar of
its `paths` when the pipeline is built (`WebdatasetLoader::PrepareMetadataImpl`; a missing one fails the
build with "File mapping failed", and a tar deleted after the build is still read from its mapping), so
a tar cannot arrive while the pipeline runs. The loader builds one pipeline per epoch; before each build
this rank's tars of the epoch (the ones its contiguous slice of samples touches) are fetched, several at
once, in the order the reader reads them; the other ranks' tars are given to DALI as sparse placeholder
files of their size (no disk blocks, never read: `stick_to_shard` keeps the reader in its slice). While
the epoch runs, the next epoch's tars are fetched in the background (its order is a function of
(seed, epoch + 1)), so only the first epoch waits for the store. docs/storage.md has the measurements.

Sharing and bounds go through file locks (flock) in the cache folder, so they hold across a node's ranks: a
lock per tar (one GET per node; a tar in use is pinned), `space.lock` for counting and reserving space,
`<name>.part` renamed to `<name>.tar` once checked against the manifest, and least recently used eviction.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dalifeed import s3
from dalifeed.format import ShardInfo, ShardManifest, file_sha256
from dalifeed.usage import parse_size

from .cachespace import CacheFull, CacheSpace, drop_unverified_entries, human

CHUNK = 2**20  # bytes per read of a GET's body


def default_folder() -> Path:
    from dalifeed.shardfolder import cache_dir

    return cache_dir() / "shards"


@dataclass(frozen=True)
class CacheConfig:
    folder: Path  # shared by the ranks of a node (local disk)
    limit: int | None = None  # bytes; None: 90% of what the folder's file system can give the cache
    verify_sha256: bool = False  # hash every tar fetched (or found) once per process, against the manifest
    parallel: int = 4  # GETs at once: how many shards ahead of the reader the fetch runs
    attempts: int = 5  # per tar, on top of botocore's own retries of each request
    backoff_s: float = 0.5  # doubled after each failed attempt


class ShardCache:
    """Tars of one shard folder in a store, fetched into `config.folder` for one rank. See the module
    docstring; `epoch_files` is what the loader calls before building an epoch's pipeline."""

    def __init__(self, manifest: ShardManifest, config: CacheConfig, log=None):
        if manifest.url is None:
            raise ValueError("a shard cache is for shard folders in a store (s3://)")
        self.manifest, self.config = manifest, config
        self.folder = Path(config.folder)
        for sub in ("shards", "locks", "placeholders"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        drop_unverified_entries(self.folder)
        self.space = CacheSpace(self.folder, config.limit)
        self.limit = self.space.limit
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._pins: dict[str, int] = {}  # cache name -> fd of its lock, held shared
        self._pins_lock = threading.Lock()
        self._verified: set[str] = set()  # names whose sha256 this process checked
        self._last: tuple[tuple, list[str]] | None = None  # the last epoch's (names, paths)
        self._prefetch = Prefetch(self.pin, config.parallel)

    # -- what the loader calls -----------------------------------------------------------------------
    def epoch_files(self, shards: list[ShardInfo], rank_range: tuple[int, int],
                    upcoming: list[ShardInfo] | None = None) -> list[str]:
        """Local paths for DALI of the epoch's tars `shards` (in the epoch's order): this rank's (those holding
        samples `rank_range` of the concatenation) fetched and pinned, the others sparse placeholders. Then
        starts fetching the tars `upcoming` (the next epoch's order) in the background."""
        key = tuple(s.path for s in shards)
        if self._last is not None and self._last[0] == key:  # asked again (an error being explained)
            return self._last[1]
        self._prefetch.stop()
        mine = rank_shards(shards, rank_range)
        need = sum(s.bytes for s in mine)
        if need > self.limit:
            raise CacheFull(f"{self.manifest.location}: the shard cache's limit {human(self.limit)} (--cache-limit) "
                            f"is below the {human(need)} of the {len(mine)} tars this rank reads in one epoch: DALI "
                            f"opens an epoch's tars when it builds its pipeline, so they must all be in the cache "
                            f"({self.folder}); raise --cache-limit or use more ranks")
        keep = {self.name(s) for s in mine}
        self._unpin_all_but(keep)  # the last epoch's pipeline is gone: its tars may be evicted
        with ThreadPoolExecutor(self.config.parallel) as pool:  # in reading order, `parallel` at once
            list(pool.map(self.pin, mine))
        paths = [str(self.path(s)) if self.name(s) in keep else str(placeholder(self.folder, s.bytes)) for s in shards]
        self._last = (key, paths)
        if upcoming is not None:
            self._prefetch.start(rank_shards(upcoming, rank_range))
        return paths

    def prefetch(self, shards: list[ShardInfo], rank_range: tuple[int, int]) -> ShardCache:
        """Start fetching this rank's tars of an epoch in the background (the loader's first epoch, while the
        trainer builds its model): `epoch_files` then finds them there, or waits for them."""
        self._prefetch.start(rank_shards(shards, rank_range))
        return self

    def close(self) -> None:
        self._prefetch.stop()
        self._unpin_all_but(set())

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- names -------------------------------------------------------------------------------------
    def name(self, shard: ShardInfo) -> str:
        """Content-addressed: a tar re-converted differently gets another name; datasets sharing a tar share it."""
        return shard.sha256 or hashlib.sha256(self.manifest.shard_location(shard).encode()).hexdigest()

    def path(self, shard: ShardInfo) -> Path:
        return self.folder / "shards" / f"{self.name(shard)}.tar"

    # -- pinning: fetch if needed, then hold shared --------------------------------------------------
    def pin(self, shard: ShardInfo) -> None:
        """Make sure the tar is in the cache, whole, and hold it (shared lock) until unpinned. CacheFull if
        there is no room, StorageError if the store fails (after retries)."""
        name = self.name(shard)
        with self._pins_lock:
            if name in self._pins:
                return
        fd = os.open(self.folder / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Held shared from here on, so that no rank evicts it. The fetch itself is under a second lock
            # that nothing holds while it waits for another: upgrading this one to exclusive instead waited
            # on the other ranks' pins while this rank held its own, and two ranks deadlocked on two tars.
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not self._usable(shard, say=False):
                with open(self.folder / "locks" / f"{name}.fetch", "a+") as fetching:
                    fcntl.flock(fetching, fcntl.LOCK_EX)  # one fetch per tar on the node; the others wait here
                    if not self._usable(shard, say=True):
                        self._fetch(shard)
            os.utime(self.path(shard))  # recently used: evicted last
        except BaseException:
            os.close(fd)
            raise
        with self._pins_lock:
            if name in self._pins:  # pinned meanwhile by another thread of this process
                os.close(fd)
            else:
                self._pins[name] = fd

    def _unpin_all_but(self, keep: set[str]) -> None:
        with self._pins_lock:
            for name in [n for n in self._pins if n not in keep]:
                os.close(self._pins.pop(name))  # closing the descriptor releases its lock

    def _usable(self, shard: ShardInfo, say: bool) -> bool:
        """The cache entry is there, of the manifest's size (and sha256, when asked). A wrong one is deleted
        (under the exclusive lock) and, with `say`, reported once."""
        path = self.path(shard)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False
        problem = None
        if size != shard.bytes:
            problem = f"{size} bytes, the manifest says {shard.bytes}"
        elif self.config.verify_sha256 and path.name not in self._verified:
            if file_sha256(path) != shard.sha256:
                problem = "sha256 differs from the manifest"
            else:
                self._verified.add(path.name)
        if problem is None:
            return True
        if say:
            self.log(f"{path}: cache entry of {self.manifest.shard_location(shard)} is wrong ({problem}): "
                     f"fetching it again")
            path.unlink(missing_ok=True)
        return False

    # -- fetching ----------------------------------------------------------------------------------
    def _fetch(self, shard: ShardInfo) -> None:
        """One GET of the whole tar into `<name>.part` (allocated first, under the space lock), checked, then
        renamed into place. Called with the tar pinned (its lock shared) and its fetch lock held exclusively."""
        url = self.manifest.shard_location(shard)
        part = self.path(shard).with_suffix(".part")
        self.space.reserve(shard.bytes, part, url)
        started, error = time.monotonic(), None
        try:
            for attempt in range(self.config.attempts):
                if attempt:
                    time.sleep(self.config.backoff_s * 2 ** (attempt - 1))
                try:
                    digest = self._download(url, part)
                    break
                except s3.ObjectProblem:
                    raise
                except s3.StorageError as e:
                    error = e
            else:
                raise s3.StorageError(f"{error} (fetching {shard.path} into the shard cache: gave up after "
                                      f"{self.config.attempts} attempts in {time.monotonic() - started:.0f} s)")
            size = part.stat().st_size
            if size != shard.bytes:
                raise s3.ObjectProblem(f"{url}: {size} bytes in the store, the manifest says {shard.bytes} "
                                       f"(truncated or replaced)")
            # Hashed while it streamed (no second read): a name in the cache is a promise about its bytes,
            # so a tar the store holds modified is refused here, never stored under the manifest's name.
            if shard.sha256 and digest != shard.sha256:
                raise s3.ObjectProblem(
                    f"{url}: its sha256 is {digest}, the manifest says {shard.sha256} (modified or corrupt in "
                    f"the store): restore the object or re-run the conversion; nothing was cached")
            self._verified.add(self.path(shard).name)
            os.replace(part, self.path(shard))
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    def _download(self, url: str, part: Path) -> str:
        """The object's bytes over the allocated `part` file, from its start; returns their sha256."""
        digest = hashlib.sha256()
        with s3.ObjectStream(url) as body, open(part, "r+b") as out:
            while True:
                chunk = body.read(CHUNK)
                if not chunk:
                    break
                try:
                    out.write(chunk)
                except OSError as e:
                    raise self.space.disk_full(e, part) from e
                digest.update(chunk)
            out.truncate()
        return digest.hexdigest()


class Prefetch:
    """`pin` run over a list of tars on a background thread, `parallel` at once, in order; stopped (and waited
    for) by `stop`, or quietly at its first failure (no room: the current epoch's tars are pinned until it
    ends; the store: the next epoch retries, and says so)."""

    def __init__(self, pin, parallel: int):
        self.pin, self.parallel = pin, parallel
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, shards: list[ShardInfo]) -> None:
        self.stop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._pin_all, args=(shards,), daemon=True,
                                        name="dalifeed-shard-prefetch")
        self._thread.start()

    def _pin_all(self, shards: list[ShardInfo]) -> None:
        def one(shard):
            if not self._stop.is_set():
                self.pin(shard)

        try:
            with ThreadPoolExecutor(self.parallel) as pool:
                for future in [pool.submit(one, s) for s in shards]:
                    future.result()
        except Exception:
            self._stop.set()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def cache_config(folder: str | os.PathLike | None, limit: int | str | None, sha256: bool = False) -> CacheConfig:
    """The shard cache a loader of a store's folder reads through (`folder` default: `shards/` in dalifeed's
    cache folder; `limit` bytes or a size as every size flag reads it: '20GB' = 20 * 10**9, '20GiB' =
    20 * 2**30; `sha256`: hash every tar against the manifest). `open_dataset` makes it, each loader opens
    its own `ShardCache` with it (its pins are that loader's epoch)."""
    return CacheConfig(Path(folder) if folder else default_folder(),
                       limit if limit is None or isinstance(limit, int) else parse_size(limit), verify_sha256=sha256)


def rank_shards(shards: list[ShardInfo], rank_range: tuple[int, int]) -> list[ShardInfo]:
    """The tars, in order, holding samples [start, end) of their concatenation (DALI's shard of a rank)."""
    start, end = rank_range
    found, position = [], 0
    for shard in shards:
        if position < end and position + shard.samples > start:
            found.append(shard)
        position += shard.samples
    return found


def placeholder(folder: Path, size: int) -> Path:
    """A sparse file of `size` bytes in the cache `folder`: DALI opens it at build and, the tar being another
    rank's, never reads it."""
    path = folder / "placeholders" / f"{size}.tar"
    if not path.is_file() or path.stat().st_size != size:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.truncate(size)
        os.replace(tmp, path)
    return path
