"""Opening a shard folder, on disk or in object storage. `open_shard_folder(location)` is the one way every
command and loader opens one (`shard-convert info`, `verify`, `export-coco`, `make_loader`,
`make_detection_loader`, `dali-bench --shards`, `dali-train --data`); the rest reads what it opened.

A local folder is read where it is. A folder in a store (s3://bucket/prefix, through `dalifeed.s3`) is
fetched: its manifest on every open (one small GET: the store is the truth), its DALI indexes once each,
into a local cache; the tars stay in the store, where DALI reads them (a ranged GET per member) and
`read_samples` streams them.

The cache folder: $DALIFEED_CACHE, else $XDG_CACHE_HOME/dalifeed, else ~/.cache/dalifeed. Its layout:
`index/<sha256>.idx` (each index once, named by its content), and `manifests/<sha256 of manifest.json>/`
holding that manifest with links to its indexes under the names it gives them, which is the folder a
`ShardManifest` fetched from a store has as `root`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from . import s3
from .atomic import write_atomic
from .format import (
    MANIFEST_NAME,
    ManifestError,
    ShardInfo,
    ShardManifest,
    check_index,
    check_split_files,
    split_member_name,
)


def open_shard_folder(location: str | os.PathLike | ShardManifest) -> ShardManifest:
    """The manifest of a shard folder, on disk or in object storage: how every command and loader opens one.

    A folder in a store is fetched: its manifest on every call (one small GET), its DALI indexes once each,
    into the local cache (`$DALIFEED_CACHE`, else `$XDG_CACHE_HOME/dalifeed`, else ~/.cache/dalifeed); the
    tars stay in the store, where DALI reads them.

    Args:
        location: A local folder, `s3://bucket/prefix`, or a manifest already opened (returned as it is).

    Returns:
        The checked manifest; for a store, with `url` set and `root` its cache folder.

    Raises:
        ManifestError: No finished shard folder at `location` (no manifest, or one that does not parse).
        StorageError: The store cannot be used (credentials, bucket, network).

    Example:
        ```python
        from dalifeed.shardfolder import open_shard_folder

        manifest = open_shard_folder("s3://bucket/imagenet-shards")
        print(manifest.kind, manifest.num_samples("train"), len(manifest.classes))
        ```
    """
    if isinstance(location, ShardManifest):
        return location
    return _fetch_manifest(str(location)) if s3.is_s3_url(location) else ShardManifest.load(location)


def cache_dir() -> Path:
    if os.environ.get("DALIFEED_CACHE"):
        return Path(os.environ["DALIFEED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dalifeed"


def _fetch_manifest(url: str) -> ShardManifest:
    """GET `url`/manifest.json and return it with `root` = its cache folder (named by its sha256) and `url`
    set. Indexes are fetched by `fetch_index`."""
    url = s3.normalize(url)
    where = s3.join(url, MANIFEST_NAME)
    try:
        data = s3.get_bytes(where)
    except s3.ObjectProblem:
        raise ManifestError(f"{where}: missing (not a dalifeed shard folder, or its conversion never finished)") \
            from None
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: unreadable manifest ({e})") from None
    view = cache_dir() / "manifests" / hashlib.sha256(data).hexdigest()
    if not (view / MANIFEST_NAME).is_file():
        view.mkdir(parents=True, exist_ok=True)
        write_atomic(view / MANIFEST_NAME, data)
    manifest = ShardManifest.from_json(view, doc, where=where)
    manifest.url = url
    return manifest


# ----------------------------------------------------------------------------------------------------
# indexes


def fetch_index(manifest: ShardManifest, shard: ShardInfo) -> Path:
    """The local path of a shard's DALI index, for a folder in a store downloaded once into the cache and
    checked against the manifest's sha256 (when it records one). ObjectProblem if it is missing or differs."""
    target = manifest.root / shard.index
    if target.is_file():
        return target
    url = s3.join(manifest.url, shard.index)
    stored = cache_dir() / "index" / f"{shard.index_sha256}.idx" if shard.index_sha256 else None
    if stored is None or not stored.is_file():
        data = s3.get_bytes(url)
        if shard.index_sha256 and hashlib.sha256(data).hexdigest() != shard.index_sha256:
            raise s3.ObjectProblem(f"{url}: sha256 differs from the manifest (modified or corrupt)")
        if stored is None:  # a manifest without index hashes: the file lives only in this manifest's folder
            write_atomic(target, data)
            return target
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(stored, data)
    try:
        os.link(stored, target)
    except FileExistsError:
        pass
    except OSError:  # another file system, or no hard links: a copy
        shutil.copyfile(stored, target)
    return target


def missing_indexes(manifest: ShardManifest, split: str) -> list[str]:
    """The names of the DALI index files of `split` that are not there: on disk, or in the store (a HEAD
    each, nothing downloaded)."""
    shards = manifest.split_info(split).shards
    if manifest.url is None:
        return [s.index for s in shards if not (manifest.root / s.index).is_file()]
    found = s3.head_many([s3.join(manifest.url, s.index) for s in shards])
    return [s.index for s, head in zip(shards, found) if head is None]


# ----------------------------------------------------------------------------------------------------
# checking a split against its manifest


def check_split(manifest: ShardManifest, split: str, sha256: bool = False) -> list[str]:
    """`format.check_split_files` in either place: on disk as it is; in a store a HEAD per tar (present,
    size), its index fetched into the cache and checked (sample count, reach), and with `sha256` every
    tar's bytes hashed."""
    if manifest.url is None:
        return check_split_files(manifest, split, sha256)
    shards = manifest.split_info(split).shards
    with ThreadPoolExecutor(s3.PARALLEL) as pool:
        return [p for problems in pool.map(lambda s: _check_shard(manifest, s, sha256), shards) for p in problems]


def _check_shard(manifest: ShardManifest, shard: ShardInfo, sha256: bool) -> list[str]:
    tar = manifest.shard_location(shard)
    found = s3.head(tar)
    if found is None:
        return [f"{tar}: missing in the store"]
    problems = []
    if found.size != shard.bytes:
        problems.append(f"{tar}: {found.size} bytes, the manifest says {shard.bytes} (truncated or replaced)")
    try:
        problems += check_index(fetch_index(manifest, shard), shard, found.size, tar)
    except s3.ObjectProblem as e:
        problems.append(f"{e} (the DALI index of {shard.path})")
    if sha256 and not problems and s3.object_sha256(tar) != shard.sha256:
        problems.append(f"{tar}: sha256 differs from the manifest (modified or corrupt)")
    return problems


# ----------------------------------------------------------------------------------------------------
# reading the tars without DALI


def open_tar(manifest: ShardManifest, shard: ShardInfo) -> BinaryIO:
    """A shard's tar as a read-only binary stream: the file, or one GET streamed from the store."""
    if manifest.url is None:
        return open(manifest.shard_location(shard), "rb")
    return s3.ObjectStream(manifest.shard_location(shard))


def read_samples(manifest: ShardManifest, split: str, members: set[str] | None = None) -> Iterator[dict]:
    """Every sample of `split` in shard order, grouped as plain webdataset groups a tar's members
    (consecutive names with the same key: `format.split_member_name`): {"__key__", "__url__", ext: bytes}, with
    only the `members` given (default: all). Each tar is streamed once; a broken one raises
    tarfile.TarError naming it, a missing one OSError or ObjectProblem."""
    for shard in manifest.split_info(split).shards:
        sample: dict | None = None
        for key, ext, data in _tar_files(manifest, shard, members):
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    yield sample
                sample = {"__key__": key, "__url__": manifest.shard_location(shard)}
            if data is not None:
                sample[ext] = data
        if sample is not None:
            yield sample


def _tar_files(manifest: ShardManifest, shard: ShardInfo, members: set[str] | None) -> Iterator[tuple]:
    """(key, ext, bytes, or None for a member not asked for) of every file in a shard's tar, in order."""
    with open_tar(manifest, shard) as stream:
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    named = split_member_name(member.name) if member.isreg() else None
                    if named is not None:
                        key, ext = named
                        wanted = members is None or ext in members
                        yield key, ext, tar.extractfile(member).read() if wanted else None
        except tarfile.TarError as e:
            raise tarfile.TarError(f"{manifest.shard_location(shard)}: unreadable tar ({e})") from e
