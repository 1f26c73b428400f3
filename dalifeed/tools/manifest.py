"""`manifest.json`: the one file every later stage reads to find shards, classes and sample counts."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_NAME = "dalifeed-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(Exception):
    """The shard folder has no usable manifest (missing, unreadable, or of another format)."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temp name in the same folder, fsync, rename: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


@dataclass
class ShardInfo:
    path: str  # relative to the manifest's folder
    index: str  # DALI .idx, relative to the manifest's folder
    samples: int
    bytes: int
    sha256: str


@dataclass
class SplitInfo:
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict:
        return {"samples": self.samples, "bytes": self.bytes, "shards": [asdict(s) for s in self.shards]}


@dataclass
class ShardManifest:
    """What a shard folder holds. `ShardManifest.load(folder)` is how pipelines and trainers find data."""

    root: Path
    kind: str
    source: str
    options: dict
    classes: list[str]
    splits: dict[str, SplitInfo]
    skipped: list[dict] = field(default_factory=list)
    reencoded: dict = field(default_factory=lambda: {"count": 0, "by_reason": {}})
    found: int = 0
    extra: dict = field(default_factory=dict)  # converter-specific fields (COCO categories, ...)
    summary: object | None = field(default=None, repr=False, compare=False)  # set by a converter run

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def num_samples(self, split: str) -> int:
        return self._split(split).samples

    def shard_paths(self, split: str) -> list[Path]:
        return [self.root / s.path for s in self._split(split).shards]

    def index_paths(self, split: str) -> list[Path]:
        return [self.root / s.index for s in self._split(split).shards]

    def _split(self, split: str) -> SplitInfo:
        if split not in self.splits:
            raise ManifestError(
                f"{self.root / MANIFEST_NAME}: no split {split!r} (has: {', '.join(sorted(self.splits)) or 'none'})"
            )
        return self.splits[split]

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "source": self.source,
            "options": self.options,
            "classes": self.classes,
            "splits": {name: info.to_json() for name, info in self.splits.items()},
            "reencoded": self.reencoded,
            "skipped": self.skipped,
            "found": self.found,
            **self.extra,
        }

    def save(self) -> Path:
        path = self.root / MANIFEST_NAME
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def load(cls, root: str | os.PathLike) -> "ShardManifest":
        root = Path(root)
        path = root / MANIFEST_NAME
        if not root.is_dir():
            raise ManifestError(f"{root}: no such shard folder")
        if not path.is_file():
            raise ManifestError(f"{path}: missing (not a dalifeed shard folder, or its conversion never finished)")
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{path}: unreadable manifest ({e})") from None
        if doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{path}: not a {FORMAT_NAME} manifest (format={doc.get('format')!r})")
        if doc.get("version") != FORMAT_VERSION:
            raise ManifestError(f"{path}: manifest version {doc.get('version')!r}, this dalifeed reads {FORMAT_VERSION}")
        known = {"format", "version", "kind", "source", "options", "classes", "splits", "reencoded", "skipped", "found"}
        try:
            splits = {
                name: SplitInfo([ShardInfo(**s) for s in info["shards"]]) for name, info in doc["splits"].items()
            }
            return cls(
                root=root,
                kind=doc["kind"],
                source=doc["source"],
                options=doc["options"],
                classes=list(doc["classes"]),
                splits=splits,
                skipped=doc.get("skipped", []),
                reencoded=doc.get("reencoded", {"count": 0, "by_reason": {}}),
                found=doc.get("found", 0),
                extra={k: v for k, v in doc.items() if k not in known},
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{path}: malformed manifest ({e!r})") from None
