"""The disk space of the node's shard cache (shardcache.py): what it holds, its limit, and the room a tar is
given before it is fetched, all under `space.lock` so that the ranks of a node never count the same free
bytes twice. Eviction deletes unpinned tars, least recently used first (a tar's mtime is touched when pinned).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from dalifeed import s3

CACHE_FORMAT = "2"  # 2: every tar was hashed as it landed; 1 (no marker): size checked only


class CacheFull(s3.StorageError):
    """The cache (its limit, or its disk) cannot hold what this rank needs now. One line with the sizes."""


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def usage(folder: Path) -> int:
    """Bytes on disk of the cache's tars and part files (allocated blocks: placeholders are not counted)."""
    total = 0
    for entry in os.scandir(folder) if folder.is_dir() else ():
        try:
            total += entry.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def drop_unverified_entries(folder: Path) -> None:
    """Delete, once, the tars a dalifeed before format 2 stored without hashing them: their name (the
    manifest's sha256) was no promise about their bytes, and a warm cache must never serve a tampered tar
    under a good name. Under the space lock, so that the ranks of a node do it once."""
    marker = folder / "format"
    with open(folder / "space.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text().strip() == CACHE_FORMAT:
            return
        for entry in (folder / "shards").iterdir():
            if entry.suffix in (".tar", ".part"):
                entry.unlink(missing_ok=True)
        tmp = marker.with_name(f".format.{os.getpid()}")
        tmp.write_text(CACHE_FORMAT + "\n")
        os.replace(tmp, marker)


class CacheSpace:
    """The bytes of the cache folder `folder` (its `shards/`, `locks/`, `space.lock`), bounded by `limit`
    (None: 90% of what its file system can give the cache)."""

    def __init__(self, folder: Path, limit: int | None):
        self.folder = folder
        self.limit = limit if limit is not None else int(0.9 * (shutil.disk_usage(folder).free
                                                                 + usage(folder / "shards")))

    def reserve(self, size: int, part: Path, location: str) -> None:
        """Make room for a tar of `size` bytes (of `location` in the store), evicting unpinned tars, and allocate
        `part` at its full size, all under the space lock. CacheFull if the limit or the disk cannot give it."""
        with open(self.folder / "space.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = usage(self.folder / "shards")
            if used + size > self.limit:
                used -= self.evict(used + size - self.limit)
            if used + size > self.limit:
                raise CacheFull(f"{location}: no room in the shard cache {self.folder}: it holds {human(used)} in "
                                f"use by the ranks of this node, the tar needs {human(size)}, the limit is "
                                f"{human(self.limit)} (--cache-limit)")
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.close(fd)
                part.unlink(missing_ok=True)
                raise self.disk_full(e, part) from e
            os.close(fd)

    def evict(self, wanted: int) -> int:
        """Delete unpinned tars (and abandoned part files), least recently used first, until `wanted` bytes
        are freed or none is left. Returns the bytes freed. Called under the space lock."""
        freed = 0
        entries = []
        for entry in os.scandir(self.folder / "shards"):
            try:
                entries.append((entry.stat().st_mtime, entry.path, entry.stat().st_blocks * 512))
            except FileNotFoundError:
                pass
        for _, path, size in sorted(entries):
            if freed >= wanted:
                break
            name = Path(path).name.rsplit(".", 1)[0]
            fd = os.open(self.folder / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # pinned or being fetched: skip it
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                os.unlink(path)
                freed += size
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        return freed

    def disk_full(self, error: OSError, part: Path) -> Exception:
        """`error` as one line with the sizes when it is the disk being full, else itself."""
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return error
        disk = shutil.disk_usage(self.folder)
        return CacheFull(f"{part}: the disk of the shard cache is full ({human(disk.free)} free of "
                         f"{human(disk.total)}; the cache holds {human(usage(self.folder / 'shards'))}, its limit "
                         f"is {human(self.limit)}): lower --cache-limit or free space")
