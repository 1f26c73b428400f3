"""`shard-convert verify`: check a shard folder against its manifest, reading every byte.

Without `--decode`: sizes, sha256, tar structure, sample counts, indexes, labels, and each image's JPEG
frame header (an encoding not every decoder reads alike is a problem even if it decodes here). With
`--decode`: every image is also decoded by PIL and by DALI's decoder, the one training uses (nvJPEG on a
GPU, libjpeg-turbo on the CPU), so a sample that would stop a training run is found here first.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import s3
from ..decode import DaliDecoder, dali_sees_gpu
from ..format import (
    CLASS_I64_MEMBER,
    CLASS_MEMBER,
    IMAGE_MEMBER,
    IMAGEFOLDER_MEMBERS,
    IMAGEFOLDER_META,
    META_MEMBER,
    TFRECORD_META,
    IndexEntry,
    ManifestError,
    ShardInfo,
    ShardManifest,
    index_text,
    meta_problems,
    split_member_name,
)
from ..shardfolder import fetch_index, open_shard_folder
from .images import DEFAULT_MAX_PIXELS, EXIF_ORIENTATION, ImageError, decode_check, read_jpeg_frame

REQUIRED_MEMBERS = IMAGEFOLDER_MEMBERS


@dataclass
class VerifyReport:
    """What `verify_shards` found.

    Attributes:
        problems: Every problem, one line each (`<file>: <what>`); empty when the folder is sound.
        shards: The shards checked.
        samples: The samples in them.
    """

    problems: list[str]
    shards: int
    samples: int

    @property
    def ok(self) -> bool:
        """No problem was found."""
        return not self.problems


def verify_shards(root: str | Path, decode: bool = False,
                  on_shard: Callable[[], object] = lambda: None) -> VerifyReport:
    """Check a shard folder against its manifest, reading every byte, as `shard-convert verify` does.

    Sizes, SHA-256, tar structure, sample counts, DALI indexes, labels and each image's JPEG header are
    checked; a folder that cannot be opened is one problem, not an exception.

    Args:
        root: The shard folder: a local path or `s3://bucket/prefix` (its manifest and indexes go to the
            local cache, each tar is read into memory).
        decode: Also decode every image, with PIL and with DALI's decoder (nvJPEG on a GPU), to find every
            sample that would stop a training run; slower. Default False.
        on_shard: Called with no argument after each shard is checked (e.g. to advance a progress bar).
            Default: nothing.

    Returns:
        The problems found and what was checked.

    Raises:
        ImportError: `decode` where DALI does not import (the message names the install).

    Example:
        ```python
        from dalifeed.convert import verify_shards

        report = verify_shards("/data/shards")
        print("sound" if report.ok else report.problems[0])
        ```
    """
    try:
        manifest = open_shard_folder(root)
    except ManifestError as e:
        return VerifyReport([str(e)], 0, 0)
    if manifest.kind == "webdataset":  # tars shard-convert index adopted: their own checks
        from .index import verify_indexed_folder

        problems = verify_indexed_folder(manifest, on_shard, dali_decoder() if decode else None)
        samples = sum(info.samples for info in manifest.splits.values())
        return VerifyReport(problems, sum(len(info.shards) for info in manifest.splits.values()), samples)
    root, remote = manifest.root, manifest if manifest.url else None
    decoder = dali_decoder() if decode else None
    max_pixels = manifest.options.get("max_pixels") or DEFAULT_MAX_PIXELS
    problems: list[str] = []
    n_shards = n_samples = 0
    check_labels = label_check(manifest)
    for _split, info in manifest.splits.items():
        for shard in info.shards:
            problems += verify_shard(root, shard, manifest.num_classes, decoder, max_pixels, check_labels, remote)
            n_shards += 1
            n_samples += shard.samples
            on_shard()
    accounted = n_samples + len(manifest.skipped)
    if manifest.found and accounted != manifest.found:
        problems.append(f"{manifest.location}/manifest.json: {manifest.found} files found but {accounted} "
                        f"accounted for ({n_samples} converted + {len(manifest.skipped)} skipped)")
    return VerifyReport(problems, n_shards, n_samples)


def dali_decoder():
    """DALI's decoder on the GPU when DALI sees one (nvJPEG, as training would use), else on the CPU; an
    ImportError naming the install where DALI does not import."""
    from ..stack import dali_import_error, dali_missing

    if (error := dali_import_error()) is not None:
        raise ImportError(dali_missing(error)) from error
    return DaliDecoder("gpu", 0) if dali_sees_gpu() else DaliDecoder("cpu")


def label_check(manifest: ShardManifest):
    """The check of a sample's non-image members for the manifest's kind: (where, members) -> problems."""
    if manifest.kind == "coco":
        from .coco import check_coco_sample

        index_of = {cid: i for i, cid in enumerate(manifest.extra["coco"]["category_ids"])}
        return lambda where, members: check_coco_sample(where, members, index_of)
    schema = TFRECORD_META if manifest.kind == "tfrecord" else IMAGEFOLDER_META
    return lambda where, members: check_class_labels(where, members, manifest.num_classes, schema)


def verify_shard(root: Path, shard: ShardInfo, num_classes: int, decoder=None,
                 max_pixels: int = DEFAULT_MAX_PIXELS, check_labels=None,
                 remote: ShardManifest | None = None) -> list[str]:
    """Problems of one shard; with `decoder` (a DaliDecoder) every image is also decoded, by PIL and DALI.
    `remote`: the manifest of a shard folder in a store, which the tar and its index are read from."""
    tar_path, idx_path = root / shard.path, root / shard.index
    if remote is not None:
        tar_path, idx_path = remote.shard_location(shard), None
        try:
            data = s3.get_bytes(tar_path)
        except s3.ObjectProblem:
            return [f"{tar_path}: missing in the store"]
    elif not tar_path.is_file():
        return [f"{tar_path}: missing"]
    else:
        data = tar_path.read_bytes()
    problems = []
    if len(data) != shard.bytes:
        problems.append(f"{tar_path}: {len(data)} bytes, the manifest says {shard.bytes} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != shard.sha256:
        problems.append(f"{tar_path}: sha256 differs from the manifest (modified or corrupt)")
    try:
        samples, index = read_samples(data)
    except (tarfile.TarError, EOFError, OSError) as e:
        return problems + [f"{tar_path}: unreadable tar: {e}"]
    if len(samples) != shard.samples:
        problems.append(f"{tar_path}: {len(samples)} samples, the manifest says {shard.samples}")
    if remote is not None:
        try:
            idx_path = fetch_index(remote, shard)
        except s3.ObjectProblem as e:
            problems.append(str(e))
    if idx_path is None:
        pass
    elif not idx_path.is_file():
        problems.append(f"{idx_path}: missing")
    elif idx_path.read_text() != index:
        problems.append(f"{idx_path}: does not match the tar (rebuild it with wds2idx or re-convert)")
    check_labels = check_labels or (lambda where, members: check_class_labels(where, members, num_classes))
    for key, members in samples.items():
        where = f"{tar_path}: sample {key}{source_of(members)}"
        label_problems = check_labels(where, members)
        problems += label_problems
        if IMAGE_MEMBER in members and not any(p.startswith(f"{where}: missing") for p in label_problems):
            problems += check_image(where, members[IMAGE_MEMBER], decoder is not None, max_pixels)
    if decoder is not None:
        keys = [key for key, members in samples.items() if IMAGE_MEMBER in members]
        warned: list[tuple[int, str]] = []
        for i, why in decoder.failures([samples[key][IMAGE_MEMBER] for key in keys], warnings=warned):
            problems.append(f"{tar_path}: sample {keys[i]}{source_of(samples[keys[i]])}: DALI cannot decode "
                            f"its .jpg ({why}): a training run would stop here")
        for i, said in warned:
            problems.append(f"{tar_path}: sample {keys[i]}{source_of(samples[keys[i]])}: DALI's libjpeg warns "
                            f"'{said}': its .jpg data are damaged, and training would read what it makes of them")
    return problems


def source_of(members: dict[str, bytes]) -> str:
    """' (source <path>)' from the sample's .json provenance, or '' when it has none."""
    try:
        doc = json.loads(members[META_MEMBER])
        path = doc.get("path") or doc.get("file_name")  # ImageFolder's, or COCO's
    except (KeyError, ValueError, AttributeError):
        return ""
    return f" (source {path})" if path else ""


def read_samples(tar: Path | bytes) -> tuple[dict[str, dict[str, bytes]], str]:
    """Members grouped by key (as webdataset groups them: consecutive, `format.split_member_name`), and the
    DALI index the tar should have, derived from the offsets tarfile reads."""
    samples: dict[str, dict[str, bytes]] = {}
    entries: list[list[IndexEntry]] = []
    last_key = None
    opened = tarfile.open(fileobj=io.BytesIO(tar), mode="r:") if isinstance(tar, bytes) else tarfile.open(tar, "r:")
    with opened as archive:
        for member in archive:
            named = split_member_name(member.name) if member.isreg() else None
            if named is None:
                continue
            key, ext = named
            payload = archive.extractfile(member).read()
            if len(payload) != member.size:
                raise EOFError(f"member {member.name} is cut short")
            if key != last_key:
                if key in samples:
                    raise tarfile.TarError(f"key {key} appears twice, not consecutively")
                samples[key], last_key = {}, key
                entries.append([])
            samples[key][ext] = payload
            entries[-1].append((ext, member.offset_data, member.size, member.name))
    return samples, index_text(entries)


def check_class_labels(where: str, members: dict[str, bytes], num_classes: int,
                       schema: dict = IMAGEFOLDER_META) -> list[str]:
    """A classification sample: .jpg, the same label in .cls, .cls.i64 and .json, within range, and a .json
    of the format's keys and types (`format.IMAGEFOLDER_META`, `format.TFRECORD_META`)."""
    missing = [ext for ext in REQUIRED_MEMBERS if ext not in members]
    if missing:
        return [f"{where}: missing {', '.join('.' + m for m in missing)}"]
    try:
        ascii_label = int(members[CLASS_MEMBER].decode("ascii"))
        binary_label = struct.unpack("<q", members[CLASS_I64_MEMBER])[0]
        meta = json.loads(members[META_MEMBER])
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        return [f"{where}: unreadable label ({e})"]
    problems = [f"{where}: .json {p}" for p in meta_problems(meta, schema)]
    if problems:
        return problems
    meta_label = meta["label"]
    if not ascii_label == binary_label == meta_label:
        problems.append(f"{where}: labels disagree (.{CLASS_MEMBER}={ascii_label}, .{CLASS_I64_MEMBER}={binary_label}, "
                        f".json={meta_label})")
    if not 0 <= binary_label < num_classes:
        problems.append(f"{where}: label {binary_label} outside 0..{num_classes - 1}")
    return problems


def check_image(where: str, jpg: bytes, decode: bool, max_pixels: int) -> list[str]:
    """The .jpg must be a JPEG every decoder reads alike (its frame header says so) and, with `decode`,
    decode in PIL, upright (no EXIF rotation that DALI would apply and PIL would not)."""
    frame = read_jpeg_frame(jpg)
    if frame is None:
        return [f"{where}: .jpg is not a JPEG (no frame header)"]
    if frame.reencode_reason() is not None:
        return [f"{where}: .jpg is a {frame.describe()}, which not every decoder reads alike "
                f"(shard-convert re-encodes these)"]
    if not decode:
        return []
    try:
        img = decode_check(jpg, max_pixels)
    except ImageError as e:
        return [f"{where}: .jpg {e}"]
    orientation = img.getexif().get(EXIF_ORIENTATION, 1)
    if orientation not in (1, None):
        return [f"{where}: .jpg carries EXIF orientation {orientation}: DALI rotates it, PIL and webdataset do not "
                f"(shard-convert stores such images upright)"]
    return []
