"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

Every file dalifeed writes that another stage reads goes through here: shards and their indexes, the
manifest, conversion progress records, checkpoints, metrics.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temp_name(path: Path) -> Path:
    """The name a file is written under before it is renamed into place (hidden, beside it, per process)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write to; on success fsyncs it and renames it over `path`,
    on failure deletes it. For writers that want a file name (torch.save, a tar writer)."""
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())
