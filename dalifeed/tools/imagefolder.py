"""ImageFolder tree -> WebDataset shards (see docs/format.md for what is written).

This module knows ImageFolder trees: classes, splits, which files belong to which class, what a sample
holds. Everything else (workers, shards, resume, locks, the manifest, jobs) is the shared core in
`convert.py`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from ..format import CLASS_I64_MEMBER, CLASS_MEMBER, IMAGE_MEMBER, META_MEMBER, ShardManifest, listing_digest
from .convert import DEFAULT_MAX_SHARD_BYTES, ConvertSummary, Plan, ShardOptions, UsageError, convert
from .images import ImageError, to_jpeg
from .shards import Sample, Skip, SourceFile

__all__ = ["ConvertConfig", "ConvertSummary", "DEFAULT_MAX_SHARD_BYTES", "UsageError", "convert_imagefolder"]


@dataclass(kw_only=True)
class ConvertConfig(ShardOptions):
    src: Path
    val_fraction: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.src = Path(self.src)

    def validate(self) -> None:
        """Check every option up front, naming the bad value."""
        self.validate_shard_options()
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not self.src.exists():
            raise UsageError(f"{self.src}: source folder does not exist")
        if not self.src.is_dir():
            raise UsageError(f"{self.src}: source is not a folder")
        if self.out.resolve() == self.src.resolve() or self.src.resolve() in self.out.resolve().parents:
            raise UsageError(f"{self.out}: output folder must not be inside the source folder {self.src}")

    def output_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"val_fraction": self.val_fraction, **self.shard_options()}


@dataclass(frozen=True)
class Item:
    """One source file: where it is (relative to SRC) and, when it is under a class folder, its label."""

    relpath: str
    label: int  # -1 for files outside any class folder (they are only ever skipped)
    class_name: str


@dataclass
class Layout:
    """What the tree holds: classes, the files of each split (in write order), the strays."""

    classes: list[str]
    splits: dict[str, list[Item]]
    stray: list[Item]  # files found where no class folder is: accounted for as skipped
    split_roots: dict[str, str]  # split -> the folder (relative to SRC) holding its class folders

    @property
    def found(self) -> int:
        return sum(len(v) for v in self.splits.values()) + len(self.stray)

    def survey(self, cfg: ConvertConfig) -> tuple[dict, dict, int]:
        """Stat every source file once: the fingerprint that decides whether OUT can be resumed (options and
        every file's path, label, size and mtime), the listings that let a reader check it holds the same
        files as an ImageFolder tree (dali-bench does), per split and, for a single tree, in all; and the
        total bytes."""
        fingerprint, entries, total = hashlib.sha256(), {}, 0
        for split, items in sorted(self.splits.items()):
            root = self.split_roots[split]
            entries[split] = []
            for item in items:
                st = (cfg.src / item.relpath).stat()
                fingerprint.update(f"{split}\0{item.relpath}\0{item.label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                entries[split].append((posixpath.relpath(item.relpath, root) if root else item.relpath, st.st_size))
                total += st.st_size
        listings = {split: listing_digest(e) for split, e in entries.items()}
        if set(self.split_roots.values()) == {""} and len(self.splits) > 1:  # splits carved out of one tree
            listings["source"] = listing_digest([e for split_entries in entries.values() for e in split_entries])
        return ({"kind": "imagefolder", "source": str(cfg.src.resolve()), "options": cfg.output_options(),
                 "listing_sha256": fingerprint.hexdigest()}, listings, total)


def find_classes(folder: Path) -> list[str]:
    """Class names exactly as torchvision's ImageFolder finds them: sorted names of sub-folders."""
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())


def list_class_files(root: Path, folder: Path, classes: list[str]) -> tuple[list[Item], list[Item]]:
    """All regular files under `folder`'s class folders (recursively, as ImageFolder walks them), in
    sorted order, plus the files lying directly in `folder`."""
    items, stray = [], []
    for label, name in enumerate(classes):
        class_dir = folder / name
        for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
            dirnames.sort()
            for filename in sorted(filenames):
                path = Path(dirpath) / filename
                items.append(Item(path.relative_to(root).as_posix(), label, name))
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file():
            stray.append(Item(Path(entry.path).relative_to(root).as_posix(), -1, ""))
    return items, stray


def files_outside(src: Path, keep: tuple[str, ...]) -> list[Item]:
    """Files of `src` that are not under the `keep` folders: never converted, but accounted for."""
    found = []
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        if Path(dirpath) == src:
            dirnames[:] = [d for d in dirnames if d not in keep]
        dirnames.sort()
        found += [Item((Path(dirpath) / f).relative_to(src).as_posix(), -1, "") for f in sorted(filenames)]
    return found


def has_split_folders(src: Path) -> bool:
    return (src / "train").is_dir() and (src / "val").is_dir()


def build_layout(cfg: ConvertConfig) -> Layout:
    """List the source, fix the class order, split it and shuffle each split with the seed."""
    src = cfg.src
    if has_split_folders(src):
        if cfg.val_fraction:
            raise UsageError(f"{src}: has train/ and val/ folders already; drop --val-fraction")
        classes = find_classes(src / "train")
        _check_classes(src / "train", classes)
        extra = sorted(set(find_classes(src / "val")) - set(classes))
        if extra:
            raise UsageError(f"{src / 'val'}: class folders not in train/: {', '.join(extra[:5])}")
        train, stray = list_class_files(src, src / "train", classes)
        val, stray_val = list_class_files(src, src / "val", classes)
        splits = {"train": train, "val": val}
        roots = {"train": "train", "val": "val"}
        stray = stray + stray_val + files_outside(src, keep=("train", "val"))
    else:
        classes = find_classes(src)
        _check_classes(src, classes)
        items, stray = list_class_files(src, src, classes)
        splits = stratified_split(items, cfg.val_fraction, cfg.seed)
        roots = {name: "" for name in splits}
    for name, items in splits.items():
        random.Random(f"{cfg.seed}:{name}").shuffle(items)
    return Layout(classes, splits, stray, roots)


def _check_classes(folder: Path, classes: list[str]) -> None:
    if not classes:
        raise UsageError(f"{folder}: no class folders (expected {folder}/<class>/<image files>)")
    for name in classes:
        if not any(files for _, _, files in os.walk(folder / name, followlinks=True)):
            raise UsageError(f"{folder / name}: class folder is empty")


def stratified_split(items: list[Item], val_fraction: float, seed: int) -> dict[str, list[Item]]:
    """Per class, a seeded `round(n * val_fraction)` of the files go to val, the rest to train."""
    if not val_fraction:
        return {"train": list(items)}
    by_class: dict[int, list[Item]] = {}
    for item in items:
        by_class.setdefault(item.label, []).append(item)
    rng = random.Random(f"{seed}:split")
    train, val = [], []
    for label in sorted(by_class):
        members = list(by_class[label])
        rng.shuffle(members)
        n_val = round(len(members) * val_fraction)
        val += members[:n_val]
        train += members[n_val:]
    return {"train": train, "val": val}


def encode_item(item: Item, src: str, quality: int, max_side: int | None, max_pixels: int) -> Sample | Skip:
    """Worker: read, decode-check and (if needed) re-encode one file; never raises for bad content."""
    path = Path(src, item.relpath)
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skip(f"unreadable: {e.strerror or e}")
    if item.label < 0:
        return Skip("outside any class folder")
    try:
        image = to_jpeg(data, quality, max_side, max_pixels)
    except ImageError as e:
        return Skip(str(e))
    # the same keys and value types in every sample (docs/format.md): "" when passed through, not null
    meta = {"path": item.relpath, "class": item.class_name, "label": item.label, "reencoded": image.reencoded or ""}
    members = [
        (IMAGE_MEMBER, SourceFile(str(path), len(data)) if image.reencoded is None else image.jpeg),
        (CLASS_MEMBER, str(item.label).encode()),
        (CLASS_I64_MEMBER, struct.pack("<q", item.label)),
        (META_MEMBER, json.dumps(meta, sort_keys=True).encode()),
    ]
    return Sample(members, image.reencoded, classes=(item.label,))


def convert_imagefolder(cfg: ConvertConfig) -> ShardManifest:
    """Convert `cfg.src` to shards in `cfg.out`; resumes an interrupted run. Returns the manifest, with
    `summary` (a ConvertSummary) attached for the CLI. Holds OUT's lock throughout (FolderInUse if another
    run does); a full disk raises DiskFull saying how much more is needed."""
    cfg.validate()
    layout = build_layout(cfg)
    fingerprint, listings, total = layout.survey(cfg)
    plan = Plan(
        kind="imagefolder", source=str(cfg.src.resolve()), splits=layout.splits, classes=layout.classes,
        encode=functools.partial(encode_item, src=str(cfg.src), quality=cfg.jpeg_quality, max_side=cfg.max_side,
                                 max_pixels=cfg.max_pixels),
        describe=describe_item, fingerprint=fingerprint, listings=listings,
        skipped=[{"path": item.relpath, "reason": "outside any class folder"} for item in layout.stray],
        found=layout.found, source_bytes=total,
    )
    return convert(plan, cfg, "shard-convert imagefolder")


def describe_item(item: Item) -> str:
    return item.relpath
