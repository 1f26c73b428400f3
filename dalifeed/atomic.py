"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

Every file dalifeed writes that another stage reads goes through here: shards and their indexes, the
manifest, conversion progress records, checkpoints, metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .runtime import DiskFull, is_disk_full


def temp_name(path: Path) -> Path:
    """The name a file is written under before it is renamed into place (hidden, beside it, per process)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write to; on success fsyncs it and renames it over `path`,
    on failure deletes it. For writers that want a file name (torch.save, a tar writer). A write that fails
    for lack of space raises `DiskFull` naming `path`."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as a RuntimeError whose context is the OSError
        full = next((x for x in (e, e.__cause__, e.__context__) if is_disk_full(x)), None)
        if full is not None:
            raise DiskFull(f"{path}: {full.strerror}") from e
        raise


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())
