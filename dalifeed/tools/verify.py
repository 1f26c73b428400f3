"""`shard-convert verify`: check a shard folder against its manifest, reading every byte."""

from __future__ import annotations

import hashlib
import json
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .images import ImageError, decode_check
from .manifest import ManifestError, ShardInfo, ShardManifest
from .shards import INDEX_VERSION, TAR_BLOCK

REQUIRED_MEMBERS = ("jpg", "cls", "label", "json")


@dataclass
class VerifyReport:
    problems: list[str]
    shards: int
    samples: int

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_shards(root: Path, decode: bool = False, on_shard=lambda: None) -> VerifyReport:
    """Every problem found, one line each (`<file>: <what>`); an empty list means the folder is sound."""
    root = Path(root)
    try:
        manifest = ShardManifest.load(root)
    except ManifestError as e:
        return VerifyReport([str(e)], 0, 0)
    problems: list[str] = []
    n_shards = n_samples = 0
    for split, info in manifest.splits.items():
        for shard in info.shards:
            problems += verify_shard(root, shard, manifest.num_classes, decode)
            n_shards += 1
            n_samples += shard.samples
            on_shard()
    accounted = n_samples + len(manifest.skipped)
    if manifest.found and accounted != manifest.found:
        problems.append(f"{root / 'manifest.json'}: {manifest.found} files found but {accounted} accounted for "
                        f"({n_samples} converted + {len(manifest.skipped)} skipped)")
    return VerifyReport(problems, n_shards, n_samples)


def verify_shard(root: Path, shard: ShardInfo, num_classes: int, decode: bool) -> list[str]:
    tar_path, idx_path = root / shard.path, root / shard.index
    if not tar_path.is_file():
        return [f"{tar_path}: missing"]
    problems = []
    data = tar_path.read_bytes()
    if len(data) != shard.bytes:
        problems.append(f"{tar_path}: {len(data)} bytes, manifest says {shard.bytes} (truncated or replaced?)")
    if hashlib.sha256(data).hexdigest() != shard.sha256:
        problems.append(f"{tar_path}: sha256 differs from the manifest (modified or corrupt)")
    try:
        samples, index = read_samples(tar_path)
    except (tarfile.TarError, EOFError, OSError) as e:
        return problems + [f"{tar_path}: unreadable tar: {e}"]
    if len(samples) != shard.samples:
        problems.append(f"{tar_path}: {len(samples)} samples, manifest says {shard.samples}")
    if not idx_path.is_file():
        problems.append(f"{idx_path}: missing")
    elif idx_path.read_text() != index:
        problems.append(f"{idx_path}: does not match the tar (rebuild it with wds2idx or re-convert)")
    for key, members in samples.items():
        problems += check_sample(tar_path, key, members, num_classes, decode)
    return problems


def read_samples(tar_path: Path) -> tuple[dict[str, dict[str, bytes]], str]:
    """Members grouped by key (as webdataset groups them: consecutive, split at the first dot), and the
    DALI index the tar should have, derived from the offsets tarfile reads."""
    samples: dict[str, dict[str, bytes]] = {}
    lines: list[list[str]] = []
    last_key = None
    with tarfile.open(tar_path, "r:") as tar:
        for member in tar:
            if not member.isreg():
                continue
            key, _, ext = member.name.partition(".")
            payload = tar.extractfile(member).read()
            if len(payload) != member.size:
                raise EOFError(f"member {member.name} is cut short")
            if key != last_key:
                if key in samples:
                    raise tarfile.TarError(f"key {key} appears twice, not consecutively")
                samples[key], last_key = {}, key
                lines.append([])
            samples[key][ext] = payload
            lines[-1].append(f"{ext} {member.offset + TAR_BLOCK} {member.size} {member.name}")
    index = f"{INDEX_VERSION} {len(lines)}\n" + "".join(" ".join(parts) + "\n" for parts in lines)
    return samples, index


def check_sample(tar_path: Path, key: str, members: dict[str, bytes], num_classes: int, decode: bool) -> list[str]:
    where = f"{tar_path}: sample {key}"
    missing = [ext for ext in REQUIRED_MEMBERS if ext not in members]
    if missing:
        return [f"{where}: missing {', '.join('.' + m for m in missing)}"]
    problems = []
    try:
        ascii_label = int(members["cls"].decode("ascii"))
        binary_label = struct.unpack("<q", members["label"])[0]
        meta_label = json.loads(members["json"])["label"]
    except (ValueError, UnicodeDecodeError, struct.error, KeyError, TypeError) as e:
        return [f"{where}: unreadable label ({e})"]
    if not ascii_label == binary_label == meta_label:
        problems.append(f"{where}: labels disagree (.cls={ascii_label}, .label={binary_label}, .json={meta_label})")
    if not 0 <= binary_label < num_classes:
        problems.append(f"{where}: label {binary_label} outside 0..{num_classes - 1}")
    if decode:
        try:
            decode_check(members["jpg"])
        except ImageError as e:
            problems.append(f"{where}: .jpg {e}")
    return problems
