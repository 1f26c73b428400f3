"""The shard folder format every stage reads (docs/format.md): `manifest.json`, the tars' DALI indexes,
and the cheap checks that the files on disk are the ones the manifest describes.

Cheap to import on purpose (no PIL, no DALI, no torch): converters write this format, pipelines and
trainers read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath

from .atomic import write_json_atomic

FORMAT_NAME = "dalifeed-shards"
# 2: binary members named `<what>.<dtype>` (`cls.i64`, `boxes.f32`, ... were `label`, `boxes`, ...) and a `.json`
# whose keys and value types are the same in every sample, so that Hugging Face `datasets` and webdataset load
# the shards (docs/format.md). Folders of version 1 are refused with a message to convert them again.
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
TAR_BLOCK = 512
INDEX_VERSION = "v1.2"  # the version DALI's wds2idx writes and fn.readers.webdataset reads
# --max-pixels: a generous default: 20000 x 15000 and other real satellite or pathology images pass, a
# decompression bomb (a few KB of PNG that expands to gigabytes) does not. Each worker holds about 3 bytes per
# pixel.
DEFAULT_MAX_PIXELS = 300_000_000

# Tar members of a sample (docs/format.md). webdataset, DALI and HF `datasets` all take everything after a
# member's first dot as its extension (HF's column name), and webdataset and HF decode a member by its *last*
# extension (`cls`, `id` -> int(), `json` -> json.loads). So the binary members DALI reads are named
# `<what>.<dtype>`: their last extension is one no tool decodes (int("\x07\0...") would fail), and no column
# of theirs is called `label`, the name a user gives `cls` (`rename_column("cls", "label")`).
IMAGE_MEMBER = "jpg"
META_MEMBER = "json"  # the same keys with the same value types in every sample of a folder
CLASS_MEMBER = "cls"  # ImageFolder: the class index as ASCII decimal (webdataset's and HF's `cls`: an int)
CLASS_I64_MEMBER = "cls.i64"  # ImageFolder: the same class index, int64 little-endian, for DALI
COCO_BOXES_MEMBER = "boxes.f32"  # COCO: (N, 4) float32 x0 y0 x1 y1 relative to the image, non-crowd
COCO_LABELS_MEMBER = "labels.i32"  # COCO: (N,) int32 training index of each box's category
COCO_CROWD_BOXES_MEMBER = "crowdboxes.f32"
COCO_CROWD_LABELS_MEMBER = "crowdlabels.i32"
COCO_ID_MEMBER = "id.i64"  # COCO: the image id, int64 little-endian
# The `.json` of every sample: these keys, values of these types, nothing else. HF `datasets` infers a column's
# type from the first 5 samples and casts the rest to it, so a key that is null in one sample and a string in
# another, an int that is a float elsewhere, a list empty in those 5, or a key only some samples have, fails
# the load or is silently dropped. COCO's records and annotations are kept as given, with whatever keys and
# types the instances file has (RLE or polygons, int or float boxes, no annotations), so they are JSON text.
IMAGEFOLDER_META = {"path": str, "class": str, "label": int, "reencoded": str}  # reencoded: "" if passed through
# TFRecord: path is the TFRecord file (relative to SRC), record its 0-based number there, filename its own
# `image/filename` ("" if it has none): what traces a sample back to where it came from.
TFRECORD_META = {"path": str, "record": int, "filename": str, "class": str, "label": int, "reencoded": str}
COCO_META = {"image_id": int, "file_name": str, "width": int, "height": int, "reencoded": str,
             "image_json": str, "annotations_json": str}
IMAGEFOLDER_MEMBERS = (IMAGE_MEMBER, CLASS_MEMBER, CLASS_I64_MEMBER, META_MEMBER)  # in tar order
COCO_MEMBERS = (IMAGE_MEMBER, META_MEMBER, COCO_BOXES_MEMBER, COCO_LABELS_MEMBER, COCO_CROWD_BOXES_MEMBER,
                COCO_CROWD_LABELS_MEMBER, COCO_ID_MEMBER)


# What a split may be called: it becomes part of file names (`<split>-000000.tar`, job records), so no path
# separator, no `..`, no leading dot (a hidden file), no space (DALI's index separates fields by spaces).
SPLIT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_split_name(name: str) -> str:
    """`name` if it can name a split; else ValueError saying why, starting with the name (the caller puts
    the option or file it came from before it). The one rule every command that takes a split name uses."""
    if not name:
        raise ValueError(f"{name!r}: a split name cannot be empty")
    if not SPLIT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{name!r}: not a split name: it becomes part of file names (<split>-000000.tar): use "
                         f"letters, digits, '_', '-' and '.', not first and not '..'")
    return name


def trains(split: str, train: bool | None) -> bool:
    """Whether a loader of `split` trains: `train` when given, else whether the split's name starts with
    "train" (`train`, `train2017`, `training`, `trainval`; docs/pipelines.md, "Which splits train"). Here
    beside the other split-name rule, below the loaders that share it (pipelines/loader.py, mixing.py)."""
    return split.startswith("train") if train is None else train


class ManifestError(Exception):
    """The shard folder has no usable manifest (missing, unreadable, or of another format)."""


@dataclass
class ShardInfo:
    """One shard (a tar) as the manifest lists it.

    Attributes:
        path: The tar's path, relative to the shard folder (or to the folder the manifest's `tars` names).
        index: Its DALI index (.idx) file, relative to the shard folder.
        samples: The samples in the tar.
        bytes: The tar's size in bytes.
        sha256: The tar's SHA-256, hex.
        index_sha256: The index file's SHA-256, hex; None in manifests written before it was recorded.
            Default None.
    """

    path: str
    index: str
    samples: int
    bytes: int
    sha256: str
    index_sha256: str | None = None

    @classmethod
    def from_json(cls, doc: dict) -> ShardInfo:
        """The shard a manifest's JSON entry describes; keys a later version added are ignored, not refused.

        Args:
            doc: One entry of a split's `shards` list in manifest.json.
        """
        return cls(**{k: v for k, v in doc.items() if k in _SHARD_FIELDS})


@dataclass
class SplitInfo:
    """One split (train, val, ...) of a shard folder.

    Attributes:
        shards: Its shards, in order. Default empty.
        class_counts: The samples holding each class, by class index; None where the converter did not count
            them. Default None.
        listing: A digest of the source files the split was made from (their number, total bytes and the
            SHA-256 of their sorted paths and sizes), so a reader can check it holds the same files as an
            ImageFolder tree; None where not recorded. Default None.
    """

    shards: list[ShardInfo] = field(default_factory=list)
    class_counts: list[int] | None = None
    listing: dict | None = None

    @property
    def samples(self) -> int:
        """The samples in the split, all shards."""
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        """The split's shards' total size in bytes."""
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict:
        """The split as manifest.json holds it."""
        doc = {"samples": self.samples, "bytes": self.bytes}
        if self.class_counts is not None:
            doc["class_counts"] = self.class_counts
        if self.listing is not None:
            doc["listing"] = self.listing
        return {**doc, "shards": [asdict(s) for s in self.shards]}


@dataclass
class ShardManifest:
    """What a shard folder holds: its manifest.json, written last by a conversion. `open_shard_folder` opens
    one, local or in a store; `ShardManifest.load` reads a local one.

    Attributes:
        root: The folder holding manifest.json and the DALI indexes (for a folder in a store: its local cache
            folder).
        kind: What the shards were made from: `"imagefolder"`, `"coco"`, `"tfrecord"`, or `"webdataset"`
            (tars made elsewhere and adopted by `shard-convert index`).
        source: The source the conversion read (a path, as given to the converter).
        options: The conversion's options that decide the output bytes.
        classes: The class names; a sample's label is an index into it.
        splits: Split name -> its shards.
        skipped: The source entries left out, each `{"path", "reason"}`. Default empty.
        reencoded: `{"count", "by_reason"}`: the images re-encoded to JPEG, and why. Default none.
        found: The source entries the conversion found, skipped ones included. Default 0.
        warnings: Lines the conversion warned with (e.g. an empty class). Default empty.
        extra: Converter-specific fields (COCO's categories, an adopted folder's label rules). Default empty.
        summary: The `ConvertSummary` a converter attaches to the manifest it returns; None when read from a
            folder. Default None.
        url: `s3://bucket/prefix` when the shards live in object storage: `root` then holds the cached
            manifest and indexes, and the tars are read from the store; None for a local folder. Default None.
        tar_root: The folder the tars are in when it is not `root` (`shard-convert index --index-dir` writes
            indexes and manifest apart from tars in a read-only folder); None: `root`. Default None.
    """

    root: Path
    kind: str
    source: str
    options: dict
    classes: list[str]
    splits: dict[str, SplitInfo]
    skipped: list[dict] = field(default_factory=list)
    reencoded: dict = field(default_factory=lambda: {"count": 0, "by_reason": {}})
    found: int = 0
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    summary: object | None = field(default=None, repr=False, compare=False)
    url: str | None = field(default=None, repr=False, compare=False)
    tar_root: Path | None = None

    @property
    def location(self) -> str:
        """Where the shard folder is, for messages: its s3:// URL or its local path."""
        return self.url or str(self.root)

    def shard_location(self, shard: ShardInfo) -> str:
        """Where DALI reads a tar from: an `s3://` URL or a local path.

        Args:
            shard: One of the manifest's shards.
        """
        return f"{self.url}/{shard.path}" if self.url else str((self.tar_root or self.root) / shard.path)

    @property
    def dali_text_label(self) -> dict | None:
        """For shards `shard-convert index` adopted, how DALI reads their ASCII labels (the manifest's
        `webdataset.label.dali`: `{"ext", "from": "member" or "name", "digits"}`); None for dalifeed's own."""
        return self.extra.get("webdataset", {}).get("label", {}).get("dali")

    def index_command(self, decode: bool = False) -> str | None:
        """For shards `shard-convert index` adopted, the command that indexes them again with the options
        they were indexed with; None for shards dalifeed wrote.

        Args:
            decode: Add `--decode` (decode every image while indexing). Default False.
        """
        if self.kind != "webdataset":
            return None
        opts = self.options
        args = ["shard-convert index"] + (["--decode"] if decode or opts.get("decode") else [])
        if self.tar_root is not None:
            args.append(f"--index-dir {self.root}")
        if opts.get("split"):
            args.append(f"--split {opts['split']}")
        if opts.get("label_member", "cls") != "cls":
            args.append(f"--label-member {opts['label_member']}")
        if opts.get("label_key"):
            args.append(f"--label-key {opts['label_key']}")
        if opts.get("classes_file"):
            args.append(f"--classes-file {opts['classes_file']}")
        if opts.get("max_pixels", DEFAULT_MAX_PIXELS) != DEFAULT_MAX_PIXELS:
            args.append(f"--max-pixels {opts['max_pixels']}")
        return " ".join(args + [str(self.tar_root) if self.tar_root is not None else self.location])

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.classes)

    def num_samples(self, split: str) -> int:
        """The samples in a split.

        Args:
            split: The split's name.

        Raises:
            ManifestError: The folder has no such split.
        """
        return self.split_info(split).samples

    def shard_paths(self, split: str) -> list[Path]:
        """The local paths of a split's tars (of a folder on disk).

        Args:
            split: The split's name.
        """
        return [Path(self.shard_location(s)) for s in self.split_info(split).shards]

    def index_paths(self, split: str) -> list[Path]:
        """The local paths of a split's DALI index files, in the order of its tars.

        Args:
            split: The split's name.
        """
        return [self.root / s.index for s in self.split_info(split).shards]

    def split_info(self, split: str) -> SplitInfo:
        """A split's shards and counts.

        Args:
            split: The split's name.

        Raises:
            ManifestError: The folder has no such split (the message lists those it has).
        """
        if split not in self.splits:
            raise ManifestError(
                f"{self.root / MANIFEST_NAME}: no split {split!r} (has: {', '.join(sorted(self.splits)) or 'none'})"
            )
        return self.splits[split]

    def to_json(self) -> dict:
        """The manifest as manifest.json holds it."""
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
            "warnings": self.warnings,
            **({"tars": str(self.tar_root)} if self.tar_root is not None else {}),
            **self.extra,
        }

    def save(self) -> Path:
        """Write manifest.json into `root` atomically (a reader sees the old file or the new one) and return
        its path."""
        path = self.root / MANIFEST_NAME
        write_json_atomic(path, self.to_json())
        return path

    def refuse_links_outside(self) -> None:
        """A local folder's tars and indexes, followed through symlinks, stay inside its tar root (and its
        indexes inside its own folder): ManifestError naming the first that leaves."""
        tars, indexes = (self.tar_root or self.root).resolve(), self.root.resolve()
        for info in self.splits.values():
            for shard in info.shards:
                for name, base in ((shard.path, tars), (shard.index, indexes)):
                    target = (base / name).resolve()
                    if not target.is_relative_to(base):
                        raise ManifestError(f"{self.root / MANIFEST_NAME}: {name} is a link to {target}, outside "
                                            f"{base}: a manifest reads only files inside its folder")

    @classmethod
    def load(cls, root: str | os.PathLike) -> ShardManifest:
        """Read the manifest of a local shard folder (`open_shard_folder` also opens one in a store).

        Args:
            root: The shard folder.

        Raises:
            ManifestError: No such folder, no manifest.json (or a conversion that never finished), a manifest
                that does not parse, or one naming files outside its folder.
        """
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
        manifest = cls.from_json(root, doc)
        manifest.refuse_links_outside()
        return manifest

    @classmethod
    def from_json(cls, root: str | os.PathLike, doc: dict, where: str | None = None) -> ShardManifest:
        """The manifest a parsed manifest.json describes. Every shard and index path it names must be
        relative and without `..`: a folder someone else made decides which files dalifeed reads, and only
        those inside it.

        Args:
            root: The folder the manifest belongs to.
            doc: The parsed manifest.json.
            where: How messages name the manifest (e.g. its `s3://` URL); None: its path in `root`.
                Default None.

        Raises:
            ManifestError: Not a dalifeed manifest, another format version, malformed, or a path leaving the
                folder.
        """
        root = Path(root)
        path = where or root / MANIFEST_NAME
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{path}: not a {FORMAT_NAME} manifest (format={doc.get('format')!r})")
        if doc.get("version") == 1:
            raise ManifestError(f"{root}: shards of dalifeed format 1 (members .label/.id/.boxes ...), this dalifeed "
                                f"reads format {FORMAT_VERSION}: convert the source again with shard-convert "
                                f"(--overwrite to replace them)")
        if doc.get("version") != FORMAT_VERSION:
            raise ManifestError(f"{path}: manifest version {doc.get('version')!r}, "
                                f"this dalifeed reads {FORMAT_VERSION}")
        known = {"format", "version", "kind", "source", "options", "classes", "splits", "reencoded", "skipped", "found",
                 "warnings", "job", "summary", "tars"}
        try:
            splits = {
                name: SplitInfo([ShardInfo.from_json(s) for s in info["shards"]], info.get("class_counts"),
                                info.get("listing"))
                for name, info in doc["splits"].items()
            }
            manifest = cls(
                root=root,
                kind=doc["kind"],
                source=doc["source"],
                options=doc["options"],
                classes=list(doc["classes"]),
                splits=splits,
                skipped=doc.get("skipped", []),
                reencoded=doc.get("reencoded", {"count": 0, "by_reason": {}}),
                found=doc.get("found", 0),
                warnings=doc.get("warnings", []),
                extra={k: v for k, v in doc.items() if k not in known},
                tar_root=Path(doc["tars"]) if doc.get("tars") else None,
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{path}: malformed manifest ({e!r})") from None
        for info in manifest.splits.values():
            for shard in info.shards:
                for name in (shard.path, shard.index):
                    if not inside_folder(name):
                        raise ManifestError(f"{path}: shard path {name!r} leaves the shard folder (paths must be "
                                            f"relative, without '..'): a manifest reads only files inside its folder")
        return manifest


_SHARD_FIELDS = {f.name for f in fields(ShardInfo)}


def inside_folder(name: object) -> bool:
    """Whether a path a manifest names stays inside the folder it is relative to: a non-empty relative path
    without `..` (symlinks are `ShardManifest.refuse_links_outside`'s)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = PurePosixPath(name).parts
    return not PurePosixPath(name).is_absolute() and ".." not in parts


def meta_problems(doc, schema: dict) -> list[str]:
    """How a sample's decoded `.json` differs from `schema` (key -> type): missing, extra or ill-typed keys."""
    if not isinstance(doc, dict):
        return [f"is {type(doc).__name__}, not an object"]
    problems = [f"has no key {key!r}" for key in schema if key not in doc]
    problems += [f"has key {key!r}, which the format does not have" for key in sorted(set(doc) - set(schema))]
    problems += [f"{key!r} is {type(doc[key]).__name__} {doc[key]!r}, not {kind.__name__}"[:200]
                 for key, kind in schema.items()
                 if key in doc and (not isinstance(doc[key], kind) or (kind is int and isinstance(doc[key], bool)))]
    return problems


def listing_digest(entries) -> dict:
    """A summary of a set of source files, `(path relative to the folder holding the class folders, size)`
    pairs, that two programs compute alike from the same tree: count, bytes and a sha256 of the sorted
    pairs. The converter stores one per split; dali-bench compares its --imagefolder against it."""
    entries = sorted(entries)
    digest = hashlib.sha256("".join(f"{path}\0{size}\n" for path, size in entries).encode()).hexdigest()
    return {"files": len(entries), "bytes": sum(size for _, size in entries), "sha256": digest}


# ----------------------------------------------------------------------------------------------------
# Tar members, DALI index files and the cheap checks run before any data is read


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member: the text before and after the first dot of its file name (after
    the last slash), as webdataset (`tariterators.base_plus_ext`) and DALI's `wds2idx` (`split_name`) both
    cut it; consecutive members with the same key are one sample. None for a member of no sample: a hidden
    file (its file name starts with a dot: wds2idx skips it) or a file name without a dot (webdataset skips
    it; wds2idx would cut off its last character). Every reader and writer of members uses this rule."""
    start = name.rfind("/") + 1
    dot = name.find(".", start)
    if dot <= start:  # no dot (-1), or a leading one
        return None
    return name[:dot], name[dot + 1:]


# One member in a DALI index: (extension, offset of its data in the tar, size, member name)
IndexEntry = tuple[str, int, int, str]


def index_text(samples: list[list[IndexEntry]]) -> str:
    """A DALI index as wds2idx writes it and fn.readers.webdataset reads it: `v1.2 N`, then one line per
    sample, its members as `ext offset size name`, space-separated. The one writer of index files."""
    lines = "".join(" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in entries) + "\n"
                    for entries in samples)
    return f"{INDEX_VERSION} {len(samples)}\n" + lines


def index_samples(idx_path: str | os.PathLike) -> Iterator[list[IndexEntry]]:
    """Each sample's members from a DALI index, in order: what `index_text` writes, read back."""
    with open(idx_path) as lines:
        next(lines)  # `v1.2 N`
        for line in lines:
            fields = line.split()
            yield [(fields[i], int(fields[i + 1]), int(fields[i + 2]), fields[i + 3])
                   for i in range(0, len(fields) - 3, 4)]


def index_sample_count(idx_path: Path) -> int:
    """The sample count an index's header line declares (`v1.2 N`). Raises ValueError if it is not one."""
    with open(idx_path, "rb") as f:
        header = f.readline(64).decode("ascii", "replace").split()
    if len(header) != 2 or header[0] != INDEX_VERSION or not header[1].isdigit():
        raise ValueError(f"not a DALI {INDEX_VERSION} index (header {' '.join(header)[:40]!r})")
    return int(header[1])


def index_data_end(idx_path: Path) -> int:
    """One past the last byte of member data the index's last line points at: the tar must reach it.
    Reads only the file's tail."""
    with open(idx_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().decode("utf-8", "replace").strip().splitlines()
    fields = lines[-1].split() if lines else []
    ends = [int(fields[i + 1]) + int(fields[i + 2]) for i in range(0, len(fields) - 3, 4)
            if fields[i + 1].isdigit() and fields[i + 2].isdigit()]
    return max(ends, default=0)


def file_sha256(path: Path, chunk: int = 2**22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def check_shard(manifest: ShardManifest, shard: ShardInfo, sha256: bool = False) -> list[str]:
    """What is wrong with one shard's files on disk against the manifest, one `<file>: <what>` line each: the
    tar's presence and size, its index's presence, sample count and reach, and (when asked, reading every
    byte) the tar's sha256. Costs two stats and two small reads per shard without sha256."""
    tar, idx = Path(manifest.shard_location(shard)), manifest.root / shard.index
    if not tar.is_file():
        return [f"{tar}: missing"]
    problems = []
    size = tar.stat().st_size
    if size != shard.bytes:
        problems.append(f"{tar}: {size} bytes, the manifest says {shard.bytes} (truncated or replaced)")
    if not idx.is_file():
        problems.append(f"{idx}: missing (the DALI index of {tar.name}; rebuild it with wds2idx or re-convert)")
    else:
        problems += check_index(idx, shard, size, str(tar))
    if sha256 and not problems and file_sha256(tar) != shard.sha256:
        problems.append(f"{tar}: sha256 differs from the manifest (modified or corrupt)")
    return problems


def check_index(idx: Path, shard: ShardInfo, tar_size: int, tar_name: str) -> list[str]:
    """What is wrong with a tar's index against the manifest and the tar's size (`tar_name` names the tar
    in messages: a path or an s3:// URL)."""
    try:
        problems = []
        count = index_sample_count(idx)
        if count != shard.samples:
            problems.append(f"{idx}: indexes {count} samples, the manifest says {shard.samples}")
        end = index_data_end(idx)
        if end > tar_size:
            problems.append(f"{tar_name}: ends at byte {tar_size} but its index points at data up to byte {end} "
                            f"(truncated)")
        return problems
    except (OSError, ValueError) as e:
        return [f"{idx}: unreadable index ({e})"]


def check_split_files(manifest: ShardManifest, split: str, sha256: bool = False) -> list[str]:
    """`check_shard` over every shard of a split."""
    return [p for shard in manifest.split_info(split).shards for p in check_shard(manifest, shard, sha256)]
