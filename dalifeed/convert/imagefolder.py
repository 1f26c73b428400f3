"""ImageFolder tree -> WebDataset shards (see docs/format.md for what is written).

This module knows ImageFolder trees: classes, splits, which files belong to which class, what a sample
holds. Everything else (workers, shards, resume, locks, the manifest, jobs) is the shared core in
`core.py`.
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
from .core import ConvertSummary, Plan, convert, stat_source
from .images import ImageError, to_jpeg
from .options import DEFAULT_MAX_SHARD_BYTES, ShardOptions, UsageError
from .shards import Sample, Skip, SourceFile

__all__ = ["ConvertConfig", "ConvertSummary", "DEFAULT_MAX_SHARD_BYTES", "UsageError", "convert_imagefolder"]


# Folder names (compared in lower case) that make a folder at the top of SRC a split, and the split each
# becomes. Every name of a validation set becomes `val`, the split dali-train evaluates on by default; the
# manifest's `split_folders` records which folder each split came from.
SPLIT_NAMES = {"train": "train", "training": "train",
               "val": "val", "valid": "val", "validation": "val", "dev": "val", "eval": "val", "evaluation": "val",
               "test": "test", "testing": "test"}
SPLIT_ORDER = ("train", "val", "test")
TOP_LEVEL = ("auto", "splits", "classes")


@dataclass(kw_only=True)
class ConvertConfig(ShardOptions):
    """The options of `shard-convert imagefolder`: an ImageFolder tree (one folder per class, optionally under
    split folders such as train/ and val/) and where its shards go. Keyword arguments only.

    Example:
        ```python
        from dalifeed.convert import ConvertConfig, convert_imagefolder

        if __name__ == "__main__":  # the conversion's workers start by importing this script
            manifest = convert_imagefolder(ConvertConfig(src="/data/imagenet", out="/data/shards"))
            print(manifest.num_samples("train"))
        ```

    Attributes:
        src: The ImageFolder tree: class folders, or split folders (train, val, validation, test, ...) of
            class folders.
        val_fraction: Hold out this fraction, in [0, 1), of every class as split `"val"` (seeded, stratified):
            of `src`, or with split folders, of train/; not allowed when `src` has a validation folder.
            Default 0.0.
        top_level: What the folders at the top of `src` are: `"auto"` (splits when all are named like splits,
            classes when none is, refused when both are there), `"splits"` (other folders' files are listed as
            skipped) or `"classes"` (every folder is a class). Default `"auto"`.
        out: Where the shards go: a local folder, or `s3://bucket/prefix` (written in a local staging folder
            and uploaded from it).
        seed: Seeds the split and the write-time shuffle: shards are written globally shuffled, since DALI
            shuffles only inside a buffer. Default 0.
        max_shard_bytes: Start a new shard before one would exceed this many bytes; None: 256 MiB
            (`256 * 2**20`), unless `samples_per_shard` alone is given. With both, a shard ends at whichever it
            reaches first. Default None.
        samples_per_shard: At most this many samples per shard; None: no count limit. Default None.
        jpeg_quality: JPEG quality, 1 to 100, of the images that must be re-encoded (not JPEG, a JPEG encoding
            not every decoder reads alike, EXIF-rotated, or shrunk by `max_side`); 8-bit RGB and greyscale
            JPEGs pass through byte for byte. Default 95.
        max_side: Re-encode images whose long side exceeds this many px down to it; None: keep sizes.
            Default None.
        max_pixels: Skip images with more pixels than this, before decoding them (a decompression bomb).
            Default 300,000,000.
        workers: Worker processes that decode-check and encode; the output bytes do not depend on it.
            Default: the CPUs this process may use (affinity, cgroup quota, `SLURM_CPUS_PER_TASK`).
        on_error: `"skip"`: list undecodable, non-image and unreadable files in the manifest's `skipped` with
            the reason; `"fail"`: stop at the first one. Default `"skip"`.
        overwrite: Replace an `out` that was made from other input or options. Default False.
        progress: Show a progress bar. Default True.
        num_jobs: Split the conversion into this many independent jobs (a Slurm array, a Kubernetes indexed
            Job), each converting its part; the last to finish writes manifest.json. Default 1.
        job_index: Which part this run converts, 0 to `num_jobs - 1`. Default 0.
        staging: With an `s3://` `out`: the local folder shards are written to and uploaded from; None: a
            folder in `$TMPDIR` named after `out`, removed when done. Default None.
        lease_stale_s: With an `s3://` `out`: seconds after which another run's lease on it, not renewed, is
            taken over. Default 60.
    """

    src: Path
    val_fraction: float = 0.0
    top_level: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.src = Path(self.src)

    def validate(self) -> None:
        """Check every option up front, naming the bad value."""
        self.validate_shard_options()
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.top_level not in TOP_LEVEL:
            raise UsageError(f"--top-level must be one of {', '.join(TOP_LEVEL)}, got {self.top_level!r}")
        if not self.src.exists():
            raise UsageError(f"{self.src}: source folder does not exist")
        if not self.src.is_dir():
            raise UsageError(f"{self.src}: source is not a folder")
        if self.folder.resolve() == self.src.resolve() or self.src.resolve() in self.folder.resolve().parents:
            raise UsageError(f"{self.folder}: output folder must not be inside the source folder {self.src}")

    def output_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"val_fraction": self.val_fraction, **self.shard_options()}


@dataclass(frozen=True)
class Item:
    """One source entry: where it is (relative to SRC), its label when it is under a class folder, its size
    and mtime as listed, and why no image can be read from it (a broken symlink, a FIFO, ...), if so."""

    relpath: str
    label: int  # -1 for files outside any class folder (they are only ever skipped)
    class_name: str
    size: int = 0
    mtime_ns: int = 0
    problem: str | None = None  # the skip reason of an entry found unreadable while listing


@dataclass
class Layout:
    """What the tree holds: classes, the files of each split (in write order), the strays."""

    classes: list[str]
    splits: dict[str, list[Item]]
    stray: list[Item]  # entries found where no class folder is: accounted for as skipped
    split_roots: dict[str, str]  # split -> the folder (relative to SRC, "" for SRC) holding its class folders

    @property
    def found(self) -> int:
        return sum(len(v) for v in self.splits.values()) + len(self.stray)

    def survey(self, cfg: ConvertConfig) -> tuple[dict, dict, int]:
        """From what listing the tree found: the fingerprint that decides whether OUT can be resumed (options
        and every file's path, label, size and mtime), the listings that let a reader check it holds the same
        files as an ImageFolder tree (dali-bench does), per split and, for splits carved out of one folder,
        of that folder in all; and the total bytes."""
        fingerprint, entries, total = hashlib.sha256(), {}, 0
        for split, items in sorted(self.splits.items()):
            root = self.split_roots[split]
            entries[split] = []
            for item in items:
                problem = f"\0{item.problem}" if item.problem else ""
                fingerprint.update(f"{split}\0{item.relpath}\0{item.label}\0{item.size}\0{item.mtime_ns}{problem}\n"
                                   .encode())
                entries[split].append((posixpath.relpath(item.relpath, root) if root else item.relpath, item.size))
                total += item.size
        listings = {split: listing_digest(e) for split, e in entries.items()}
        carved = [split for split in self.splits if list(self.split_roots.values()).count(self.split_roots[split]) > 1]
        if carved:  # --val-fraction split one folder in two: a reader of that folder holds both
            listings["source"] = listing_digest([e for split in carved for e in entries[split]])
        return ({"kind": "imagefolder", "source": str(cfg.src.resolve()), "options": cfg.output_options(),
                 "listing_sha256": fingerprint.hexdigest()}, listings, total)

    @property
    def split_folders(self) -> dict[str, str]:
        """split -> the folder of SRC it was made from ("." for SRC itself), for the manifest."""
        return {split: self.split_roots[split] or "." for split in self.splits}


def is_folder(entry: os.DirEntry) -> bool:
    """Whether an entry is a folder, following symlinks; False for one that cannot be stat-ed (a symlink
    loop raises where a broken link does not)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def find_classes(folder: Path) -> list[str]:
    """Class names exactly as torchvision's ImageFolder finds them: sorted names of sub-folders."""
    try:
        with os.scandir(folder) as entries:
            return sorted(entry.name for entry in entries if is_folder(entry))
    except OSError as e:  # SRC or a split folder: nothing can be converted from it
        raise UsageError(f"{folder}: cannot read this folder ({e.strerror or e})") from None


def source_item(root: Path, path: Path, label: int = -1, class_name: str = "", problem: str | None = None) -> Item:
    """An Item for `path`, stat-ed once here (a problem found while walking wins over what stat finds)."""
    found = stat_source(path)
    return Item(path.relative_to(root).as_posix(), label, class_name, found.size, found.mtime_ns,
                problem or found.problem)


def entries_under(folder: Path) -> list[tuple[Path, str | None]]:
    """Every entry under `folder` that is not a folder, recursively, following symlinked folders as
    torchvision's ImageFolder walks them (a folder's files sorted, then its sub-folders sorted), each with
    None or a reason no image can come from it: a sub-folder that cannot be listed, and a symlink back to a
    folder above it (which a walk would follow until the path is too long), are entries too, with why."""
    found: list[tuple[Path, str | None]] = []
    # the folders on the way down to each folder being walked, from / (a link to SRC is a loop too)
    above = {str(folder): {_identity(f) for f in (folder.resolve(), *folder.resolve().parents)}}

    def unreadable(error: OSError) -> None:
        found.append((Path(error.filename), f"unreadable folder: {error.strerror or error}"))

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable, followlinks=True):
        ancestors = above.pop(dirpath)
        found += [(Path(dirpath, name), None) for name in sorted(filenames)]
        keep = []
        for name in sorted(dirnames):
            path = Path(dirpath, name)
            identity = _identity(path)
            if identity in ancestors:
                target = f"links to {os.readlink(path)}, " if path.is_symlink() else ""
                found.append((path, f"unreadable: symlink loop ({target}a folder above it)"))
                continue
            keep.append(name)
            above[os.path.join(dirpath, name)] = ancestors | {identity}
        dirnames[:] = keep
    return found


def _identity(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino


def list_class_files(root: Path, folder: Path, classes: list[str]) -> tuple[list[Item], list[Item]]:
    """All entries under `folder`'s class folders (recursively, as ImageFolder walks them), in sorted order,
    labelled by their class's index in `classes` (a class without a folder here has no entries), plus the
    entries lying directly in `folder` (anything but a folder: a file, a broken symlink, a FIFO)."""
    items, stray = [], []
    here = set(find_classes(folder))
    for label, name in enumerate(classes):
        if name in here:
            items += [source_item(root, path, label, name, problem) for path, problem in entries_under(folder / name)]
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if not is_folder(entry):
                stray.append(source_item(root, Path(entry.path)))
    return items, stray


def files_outside(src: Path, keep: tuple[str, ...]) -> list[Item]:
    """The entries of `src` outside its `keep` folders (those lying in `src`, then those under its other
    folders), in the order os.walk finds them: never converted, but accounted for."""
    with os.scandir(src) as scanned:
        entries = sorted(scanned, key=lambda e: e.name)
    found = [source_item(src, Path(entry.path)) for entry in entries if not is_folder(entry)]
    for entry in entries:
        if is_folder(entry) and entry.name not in keep:
            found += [source_item(src, path, problem=problem) for path, problem in entries_under(Path(entry.path))]
    return found


def find_split_folders(src: Path, top_level: str) -> dict[str, str]:
    """split -> the folder at the top of SRC holding it, in the order train, val, test; {} when the folders
    at the top of SRC are classes. With `top_level` "auto", folders named like splits (SPLIT_NAMES) are
    splits when every other folder is hidden (a leading dot); a mix of split names and other names is
    refused, naming both and the options that say what was meant."""
    if top_level == "classes":
        return {}
    folders = find_classes(src)
    splits: dict[str, str] = {}
    for name in folders:
        split = SPLIT_NAMES.get(name.lower())
        if split is None:
            continue
        if split in splits:
            raise UsageError(f"{src}: {splits[split]}/ and {name}/ would both be split '{split}': keep one, or "
                             f"convert each on its own (as SRC)")
        splits[split] = name
    others = [name for name in folders if name.lower() not in SPLIT_NAMES and not name.startswith(".")]
    if top_level == "splits" and not splits:
        raise UsageError(f"{src}: --top-level splits, but no folder at its top is named like a split "
                         f"({', '.join(SPLIT_NAMES)})")
    if top_level == "auto" and splits and others:
        raise UsageError(f"{src}: split folders ({', '.join(f'{n}/' for n in splits.values())}) beside other "
                         f"folders ({', '.join(f'{n}/' for n in others[:4])}{', ...' if len(others) > 4 else ''}): "
                         f"add --top-level splits to convert the splits (the other folders' files are listed as "
                         f"skipped), --top-level classes to make every folder a class, or give one split folder as SRC")
    return {split: splits[split] for split in SPLIT_ORDER if split in splits}


def build_layout(cfg: ConvertConfig) -> Layout:
    """List the source, fix the class order, split it and shuffle each split with the seed."""
    src = cfg.src
    folders = find_split_folders(src, cfg.top_level)
    if folders:
        classes, splits, stray = list_split_folders(src, folders)
        roots = dict(folders)
        if cfg.val_fraction:
            splits, roots = carve_val(src, splits, roots, cfg)
    else:
        classes = find_classes(src)
        _check_classes(src, classes)
        items, stray = list_class_files(src, src, classes)
        splits = stratified_split(items, cfg.val_fraction, cfg.seed)
        roots = {name: "" for name in splits}
    for name, items in splits.items():
        random.Random(f"{cfg.seed}:{name}").shuffle(items)
    return Layout(classes, splits, stray, roots)


def list_split_folders(src: Path, folders: dict[str, str]) -> tuple[list[str], dict[str, list[Item]], list[Item]]:
    """Classes, items per split and strays of a tree with split folders. The classes are train's, as
    torchvision's ImageFolder(SRC/train) numbers them (without a train split, those of all splits): another
    split may lack a class, not add one. A split folder without class folders (an unlabelled test set) is
    refused: its files could only be skipped."""
    found = {split: find_classes(src / folder) for split, folder in folders.items()}
    for split, folder in folders.items():
        if not found[split]:
            raise UsageError(f"{src / folder}: no class folders (expected {src / folder}/<class>/<image files>); "
                             f"an unlabelled split cannot be converted: move it out of {src}")
    if "train" in folders:
        classes = found["train"]
        _check_classes(src / folders["train"], classes)
    else:
        classes = sorted(set().union(*found.values()))
    for split, folder in folders.items():
        extra = sorted(set(found[split]) - set(classes))
        if extra:
            raise UsageError(f"{src / folder}: class folders not in {folders['train']}/: {', '.join(extra[:5])}")
    splits, stray = {}, []
    for split, folder in folders.items():
        splits[split], loose = list_class_files(src, src / folder, classes)
        stray += loose
    return classes, splits, stray + files_outside(src, keep=tuple(folders.values()))


def carve_val(src: Path, splits: dict[str, list[Item]], roots: dict[str, str],
              cfg: ConvertConfig) -> tuple[dict[str, list[Item]], dict[str, str]]:
    """--val-fraction with split folders: val is held out of train (stratified, seeded), as it would be
    from a single tree; refused when there is a val folder already or no train folder."""
    if "val" in roots:
        raise UsageError(f"{src}: has a validation folder already ({roots['val']}/, split 'val'); drop --val-fraction")
    if "train" not in roots:
        raise UsageError(f"{src}: --val-fraction holds val out of the train folder, and there is none "
                         f"(split folders: {', '.join(f'{f}/' for f in roots.values())})")
    carved = stratified_split(splits["train"], cfg.val_fraction, cfg.seed)
    splits = {"train": carved["train"], "val": carved["val"], **{k: v for k, v in splits.items() if k != "train"}}
    return splits, {**roots, "val": roots["train"]}


def _check_classes(folder: Path, classes: list[str]) -> None:
    if not classes:
        raise UsageError(f"{folder}: no class folders (expected {folder}/<class>/<image files>)")
    for name in classes:
        try:
            with os.scandir(folder / name):
                pass
        except OSError as e:
            raise UsageError(f"{folder / name}: cannot read this class folder ({e.strerror or e})") from None
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
    largest = max(len(members) for members in by_class.values())
    if not val:  # an empty val split, written without a word, would only be refused later by dali-train
        how = (f"raise it above {0.5 / largest:.2g}" if largest > 1 else
               "a class needs 2 images or more to give one to val")
        raise UsageError(f"--val-fraction {val_fraction:g} holds out no image: round(n x {val_fraction:g}) is 0 for "
                         f"every class (the largest has {largest}): {how}, or drop it for no val split")
    emptied = sorted(label for label, members in by_class.items() if round(len(members) * val_fraction) >= len(members))
    if emptied:
        raise UsageError(f"--val-fraction {val_fraction:g} holds out every image of {len(emptied)} class(es) (class "
                         f"index {emptied[0]} has {len(by_class[emptied[0]])}): training would never see them; "
                         f"lower it")
    return {"train": train, "val": val}


def encode_item(item: Item, src: str, quality: int, max_side: int | None, max_pixels: int) -> Sample | Skip:
    """Worker: read, decode-check and (if needed) re-encode one file; never raises for bad content."""
    if item.problem:  # found while listing; a FIFO must not even be opened (reading it blocks)
        return Skip(item.problem)
    if item.label < 0:
        return Skip("outside any class folder")
    path = Path(src, item.relpath)
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skip(f"unreadable: {e.strerror or e}")
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
    """Convert the ImageFolder tree `cfg.src` to shards in `cfg.out`, as `shard-convert imagefolder` does.

    An interrupted conversion of the same input and options continues where it stopped; the manifest is
    written last, so a folder without one is never read as finished. `cfg.out`'s lock is held throughout.
    Call it under `if __name__ == "__main__":` in a script: the workers start by importing it.

    Args:
        cfg: The tree, the output folder and the conversion's options.

    Returns:
        The written folder's manifest, with `summary` (a `ConvertSummary`: samples written, skipped, time)
        attached.

    Raises:
        UsageError: An option is out of range, `src` is missing, or `out` holds another conversion.
        ConversionFailed: With `on_error="fail"`, the first file that is not a readable image.
        FolderInUse: Another conversion holds `out`'s lock.
        DiskFull: The disk filled up; the message says how much more is needed.

    Example:
        ```python
        from dalifeed.convert import ConvertConfig, convert_imagefolder

        if __name__ == "__main__":
            manifest = convert_imagefolder(ConvertConfig(src="/data/imagenet", out="/data/shards", workers=8))
            print(manifest.summary.samples, "samples in", manifest.summary.shards, "shards")
        ```
    """
    cfg.validate()
    layout = build_layout(cfg)
    fingerprint, listings, total = layout.survey(cfg)
    plan = Plan(
        kind="imagefolder", source=str(cfg.src.resolve()), splits=layout.splits, classes=layout.classes,
        encode=functools.partial(encode_item, src=str(cfg.src), quality=cfg.jpeg_quality, max_side=cfg.max_side,
                                 max_pixels=cfg.max_pixels),
        describe=describe_item, fingerprint=fingerprint, listings=listings,
        skipped=[{"path": item.relpath, "reason": item.problem or "outside any class folder"} for item in layout.stray],
        found=layout.found, source_bytes=total, extra={"split_folders": layout.split_folders},
    )
    return convert(plan, cfg, "shard-convert imagefolder")


def describe_item(item: Item) -> str:
    return item.relpath
