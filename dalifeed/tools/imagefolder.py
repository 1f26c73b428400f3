"""ImageFolder tree -> WebDataset shards (see docs/format.md for what is written)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import random
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..atomic import write_json_atomic
from ..format import MANIFEST_NAME, ShardManifest, SplitInfo, listing_digest
from ..runtime import LOCK_NAME, DiskFull, folder_lock, free_bytes, mib
from .images import DEFAULT_MAX_PIXELS, ImageError, to_jpeg
from .shards import PROGRESS_DIR, ProgressStore, Sample, Skip, SourceFile, remove_outputs, write_split

DEFAULT_MAX_SHARD_BYTES = 256 * 2**20


class UsageError(Exception):
    """Bad input or options: the CLI prints the message in one line and exits 2."""


@dataclass
class ConvertConfig:
    src: Path
    out: Path
    val_fraction: float = 0.0
    seed: int = 0
    max_shard_bytes: int | None = None  # None: 256 MiB, unless samples_per_shard alone is given
    samples_per_shard: int | None = None
    jpeg_quality: int = 95
    max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    on_error: str = "skip"
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        self.src, self.out = Path(self.src), Path(self.out)
        # One limit given: that one. Both: a shard ends at whichever it reaches first. Neither: 256 MiB.
        if self.max_shard_bytes is None and self.samples_per_shard is None:
            self.max_shard_bytes = DEFAULT_MAX_SHARD_BYTES

    def validate(self) -> None:
        """Check every option up front, naming the bad value."""
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise UsageError(f"--samples-per-shard must be >= 1, got {self.samples_per_shard}")
        if self.max_shard_bytes is not None and self.max_shard_bytes < 4096:
            raise UsageError(f"--max-shard-bytes must be >= 4096, got {self.max_shard_bytes}")
        if not 1 <= self.jpeg_quality <= 100:
            raise UsageError(f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}")
        if self.max_side is not None and self.max_side < 8:
            raise UsageError(f"--max-side must be >= 8, got {self.max_side}")
        if self.max_pixels < 1:
            raise UsageError(f"--max-pixels must be >= 1, got {self.max_pixels}")
        if self.workers < 1:
            raise UsageError(f"--workers must be >= 1, got {self.workers}")
        if self.on_error not in ("skip", "fail"):
            raise UsageError(f"--on-error must be 'skip' or 'fail', got {self.on_error!r}")
        if self.out.exists() and not self.out.is_dir():
            raise UsageError(f"{self.out}: output exists and is not a folder")
        if not self.src.exists():
            raise UsageError(f"{self.src}: source folder does not exist")
        if not self.src.is_dir():
            raise UsageError(f"{self.src}: source is not a folder")
        if self.out.resolve() == self.src.resolve() or self.src.resolve() in self.out.resolve().parents:
            raise UsageError(f"{self.out}: output folder must not be inside the source folder {self.src}")

    def output_options(self) -> dict:
        """The options that decide the output bytes (workers and progress do not)."""
        return {"seed": self.seed, "val_fraction": self.val_fraction, "jpeg_quality": self.jpeg_quality,
                "max_side": self.max_side, "max_pixels": self.max_pixels, "samples_per_shard": self.samples_per_shard,
                "max_shard_bytes": self.max_shard_bytes}

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Item:
    """One source file: where it is (relative to SRC) and, when it is under a class folder, its label."""

    relpath: str
    label: int  # -1 for files outside any class folder (they are only ever skipped)
    class_name: str


@dataclass
class Plan:
    classes: list[str]
    splits: dict[str, list[Item]]
    stray: list[Item]  # files found where no class folder is: accounted for as skipped
    split_roots: dict[str, str]  # split -> the folder (relative to SRC) holding its class folders

    @property
    def found(self) -> int:
        return sum(len(v) for v in self.splits.values()) + len(self.stray)

    def survey(self, cfg: ConvertConfig) -> tuple[dict, dict]:
        """Stat every source file once: the fingerprint that decides whether OUT can be resumed (options and
        every file's path, label, size and mtime), and the listings that let a reader check it holds the
        same files as an ImageFolder tree (dali-bench does), per split and, for a single tree, in all."""
        fingerprint, entries = hashlib.sha256(), {}
        for split, items in sorted(self.splits.items()):
            root = self.split_roots[split]
            entries[split] = []
            for item in items:
                st = (cfg.src / item.relpath).stat()
                fingerprint.update(f"{split}\0{item.relpath}\0{item.label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                entries[split].append((posixpath.relpath(item.relpath, root) if root else item.relpath, st.st_size))
        listings = {split: listing_digest(e) for split, e in entries.items()}
        if set(self.split_roots.values()) == {""} and len(self.splits) > 1:  # splits carved out of one tree
            listings["source"] = listing_digest([e for split_entries in entries.values() for e in split_entries])
        return ({"kind": "imagefolder", "source": str(cfg.src.resolve()), "options": cfg.output_options(),
                 "listing_sha256": fingerprint.hexdigest()}, listings)


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


def build_plan(cfg: ConvertConfig) -> Plan:
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
    return Plan(classes, splits, stray, roots)


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
    meta = {"path": item.relpath, "class": item.class_name, "label": item.label, "reencoded": image.reencoded}
    members = [
        ("jpg", SourceFile(str(path), len(data)) if image.reencoded is None else image.jpeg),
        ("cls", str(item.label).encode()),
        ("label", struct.pack("<q", item.label)),
        ("json", json.dumps(meta, sort_keys=True).encode()),
    ]
    return Sample(members, image.reencoded, classes=(item.label,))


def prepare_output(cfg: ConvertConfig, fingerprint: dict) -> str:
    """Decide what to do with OUT (which exists, locked by this run): 'fresh', 'resume' or 'done'. Refuse a
    folder made differently, saying what differs."""
    out = cfg.out
    store = ProgressStore(out)
    manifest_path = out / MANIFEST_NAME
    existing = None
    if store.exists():
        existing = store.fingerprint()
    elif manifest_path.is_file():
        try:
            existing = json.loads(manifest_path.read_text()).get("fingerprint")
        except (OSError, json.JSONDecodeError):
            existing = None
    if cfg.overwrite:
        remove_outputs(out)
        return "fresh"
    if existing == fingerprint:
        return "done" if manifest_path.is_file() and not store.exists() else "resume"
    if any(p.name not in (PROGRESS_DIR, LOCK_NAME) for p in out.iterdir()):
        why = f"made with other input: {describe_difference(existing, fingerprint)}" if existing else "not empty"
        raise UsageError(f"{out}: output folder {why}; use --overwrite to replace it or choose another OUT")
    return "fresh"


def describe_difference(old: dict, new: dict) -> str:
    """What changed between two fingerprints, e.g. "--seed was 1, now 2; source was /a, now /b"."""
    changes = [f"{name} was {old.get(name)}, now {new[name]}" for name in ("kind", "source")
               if old.get(name) != new[name]]
    old_options, new_options = old.get("options", {}), new["options"]
    for name in sorted(set(old_options) | set(new_options)):
        if old_options.get(name) != new_options.get(name):
            changes.append(f"--{name.replace('_', '-')} was {old_options.get(name)}, now {new_options.get(name)}")
    if not changes and old.get("listing_sha256") != new.get("listing_sha256"):
        changes.append("the source files changed since (added, removed, renamed or modified)")
    return "; ".join(changes) or "an older dalifeed version"


@dataclass
class ConvertSummary:
    samples: int
    shards: int
    bytes: int
    skipped: int
    reencoded: int
    seconds: float
    status: str  # fresh | resume | done

    @property
    def images_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def convert_imagefolder(cfg: ConvertConfig) -> ShardManifest:
    """Convert `cfg.src` to shards in `cfg.out`; resumes an interrupted run. Returns the manifest, with
    `summary` (a ConvertSummary) attached for the CLI. Holds OUT's lock throughout (FolderInUse if another
    run does); a full disk raises DiskFull saying how much more is needed."""
    cfg.validate()
    started = time.perf_counter()
    plan = build_plan(cfg)
    fingerprint, listings = plan.survey(cfg)
    with folder_lock(cfg.out, "shard-convert imagefolder"):
        status = prepare_output(cfg, fingerprint)
        if status == "done":
            manifest = ShardManifest.load(cfg.out)
            manifest.summary = _summary(manifest, time.perf_counter() - started, status)
            return manifest
        try:
            manifest = write_shards(cfg, plan, fingerprint, listings)
        except DiskFull as e:
            written = sum(p.stat().st_size for p in cfg.out.glob("*.tar"))
            needed = max(0, sum(listing["bytes"] for name, listing in listings.items() if name != "source") - written)
            raise DiskFull(f"{e} ({mib(free_bytes(cfg.out))} free; the images not converted yet need about "
                           f"{mib(needed)} more): free space, then run the same command again to resume") from e
    manifest.summary = _summary(manifest, time.perf_counter() - started, status)
    return manifest


def write_shards(cfg: ConvertConfig, plan: Plan, fingerprint: dict, listings: dict) -> ShardManifest:
    store = ProgressStore(cfg.out)
    store.start(fingerprint)
    encode = functools.partial(encode_item, src=str(cfg.src), quality=cfg.jpeg_quality, max_side=cfg.max_side,
                               max_pixels=cfg.max_pixels)
    splits, skipped, reencoded, warnings = {}, [], {}, []
    bar = tqdm(total=plan.found, unit="img", desc="shard-convert", disable=not cfg.progress, dynamic_ncols=True,
               mininterval=0.5)
    with bar:
        for split, items in plan.splits.items():
            bar.set_postfix_str(split)
            result = write_split(
                cfg.out, split, items, encode, describe=lambda item: item.relpath, workers=cfg.workers,
                max_shard_bytes=cfg.max_shard_bytes, samples_per_shard=cfg.samples_per_shard,
                progress=store, on_error=cfg.on_error, on_items=bar.update,
            )
            class_counts = [result.classes.get(str(label), 0) for label in range(len(plan.classes))]
            splits[split] = SplitInfo(result.shards, class_counts, listings[split])
            skipped += result.skipped
            warnings += result.warnings
            for reason, n in result.reencoded.items():
                reencoded[reason] = reencoded.get(reason, 0) + n
        for item in plan.stray:
            skipped.append({"path": item.relpath, "reason": "outside any class folder"})
            bar.update(1)

    extra = {"fingerprint": fingerprint, **({"source_listing": listings["source"]} if "source" in listings else {})}
    manifest = ShardManifest(
        root=cfg.out, kind="imagefolder", source=str(cfg.src.resolve()), options=cfg.output_options(),
        classes=plan.classes, splits=splits, skipped=skipped, found=plan.found,
        reencoded={"count": sum(reencoded.values()), "by_reason": dict(sorted(reencoded.items()))},
        warnings=warnings, extra=extra,
    )
    manifest.summary = _summary(manifest, 0.0, "fresh")
    write_json_atomic(cfg.out / "convert.json", {"config": cfg.to_json(), "summary": asdict(manifest.summary)})
    manifest.save()  # last: its presence means the folder is complete
    store.remove()
    return manifest


def _summary(manifest: ShardManifest, seconds: float, status: str) -> ConvertSummary:
    return ConvertSummary(
        samples=sum(s.samples for s in manifest.splits.values()),
        shards=sum(len(s.shards) for s in manifest.splits.values()),
        bytes=sum(s.bytes for s in manifest.splits.values()),
        skipped=len(manifest.skipped), reencoded=manifest.reencoded.get("count", 0),
        seconds=seconds, status=status,
    )
