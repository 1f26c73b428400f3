"""COCO (images + instances JSON) -> WebDataset shards, and back (docs/coco.md, docs/format.md).

This module knows COCO instances files: their keys and types, categories, which annotation belongs to which
image, which boxes can be training targets, and what a sample holds. Workers, shards, resume, locks, the
manifest and jobs are the shared core in `core.py`.

One sample per image record (member names in `dalifeed.format`):
  jpg              the image (passed through or re-encoded under the ImageFolder rules)
  json             the record's id, file_name, width and height, why the image was re-encoded ("" if not), and
                   the record and its annotations as given, as JSON text (`image_json`, `annotations_json`):
                   `export-coco` rebuilds the instances file from these alone. Text, because records and
                   annotations as given vary in keys and types, which tools that infer one schema for all
                   samples (HF `datasets`) cannot load.
  boxes.f32        float32 (N, 4) little-endian, x0 y0 x1 y1 relative to the image (0..1), non-crowd boxes,
                   clipped to the image; boxes of no area after clipping are left out (they stay in `json`)
  labels.i32       int32 (N,), the training index of each box's category (categories sorted by id)
  crowdboxes.f32, crowdlabels.i32: the same for `iscrowd` annotations
  id.i64           int64, the image id
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import struct
import tarfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..format import (
    COCO_BOXES_MEMBER,
    COCO_CROWD_BOXES_MEMBER,
    COCO_CROWD_LABELS_MEMBER,
    COCO_ID_MEMBER,
    COCO_LABELS_MEMBER,
    COCO_MEMBERS,
    COCO_META,
    IMAGE_MEMBER,
    META_MEMBER,
    ShardManifest,
    check_split_name,
    listing_digest,
    meta_problems,
)
from ..shardfolder import open_shard_folder, read_samples
from .core import Plan, convert, stat_source
from .images import ImageError, to_jpeg
from .options import ShardOptions, UsageError
from .shards import Sample, Skip, SourceFile

REQUIRED_KEYS = ("images", "annotations", "categories")
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that exchange width and height


@dataclass(kw_only=True)
class CocoConfig(ShardOptions):
    """The options of `shard-convert coco`: COCO splits (an image folder and its instances file each) and
    where their shards go. Keyword arguments only.

    Each image becomes one sample: the image, its record and annotations as JSON, its boxes (x0, y0, x1, y1
    relative to the image) and their category indices.

    Example:
        ```python
        from dalifeed.convert import CocoConfig, convert_coco

        if __name__ == "__main__":  # the conversion's workers start by importing this script
            cfg = CocoConfig(images=["coco/train2017", "coco/val2017"], out="/data/coco-shards",
                             annotations=["coco/annotations/instances_train2017.json",
                                          "coco/annotations/instances_val2017.json"])
            convert_coco(cfg)
        ```

    Attributes:
        images: One image folder per split, in the order of `annotations`.
        annotations: One COCO instances file per split.
        split: The splits' names, one per instances file; empty: each file's name without `instances_` and
            `.json` (instances_val2017.json: `val2017`). Default empty.
        skip_empty: Leave out images without annotations (listed in the manifest's `skipped`); False keeps
            them, since detectors learn from background images too. Default False.
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

    images: list[Path]
    annotations: list[Path]
    split: list[str] = field(default_factory=list)
    skip_empty: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.images = [Path(p) for p in self.images]
        self.annotations = [Path(p) for p in self.annotations]
        self.split = list(self.split) or [split_name(p) for p in self.annotations]

    def validate(self) -> None:
        """Check every option up front, naming the bad value (`UsageError`)."""
        self.validate_shard_options()
        if not self.annotations:
            raise UsageError("give at least one --images DIR --annotations FILE pair")
        if len(self.images) != len(self.annotations):
            raise UsageError(f"--images given {len(self.images)} times and --annotations {len(self.annotations)} "
                             f"times: give one --images folder per instances file")
        if len(self.split) != len(self.annotations):
            raise UsageError(f"--split given {len(self.split)} times for {len(self.annotations)} instances files")
        if len(set(self.split)) != len(self.split):
            raise UsageError(f"split names repeat: {', '.join(self.split)} (name them with --split)")
        for name in self.split:
            try:
                check_split_name(name)
            except ValueError as e:
                raise UsageError(f"split {e} (--split NAME)") from None
        for folder in self.images:
            if not folder.is_dir():
                raise UsageError(f"{folder}: image folder does not exist" if not folder.exists()
                                 else f"{folder}: --images is not a folder")
            if self.folder.resolve() == folder.resolve() or folder.resolve() in self.folder.resolve().parents:
                raise UsageError(f"{self.folder}: output folder must not be inside the image folder {folder}")
        for path in self.annotations:
            if not path.is_file():
                raise UsageError(f"{path}: --annotations is a folder, not an instances file" if path.is_dir()
                                 else f"{path}: instances file does not exist")

    def output_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"skip_empty": self.skip_empty, **self.shard_options()}


def split_name(annotations: Path) -> str:
    """instances_train2017.json -> train2017, as COCO names its files."""
    stem = Path(annotations).stem
    return stem[len("instances_"):] if stem.startswith("instances_") else stem


# ----------------------------------------------------------------------------------------------------
# reading and checking an instances file


def load_instances(path: Path) -> dict:
    """Parse and check an instances file; a malformed one is a UsageError naming the key."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UsageError(f"{path}: not a JSON file ({getattr(e, 'msg', e)}{where})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: top level must be a JSON object with images, annotations and categories, "
                         f"got {_type(doc)}")
    for key in REQUIRED_KEYS:
        if key not in doc:
            raise UsageError(f"{path}: missing key '{key}' (a COCO instances file has images, annotations and "
                             f"categories)")
        if not isinstance(doc[key], list):
            raise UsageError(f"{path}: '{key}' must be a list, got {_type(doc[key])}")
    for i, image in enumerate(doc["images"]):
        _check_record(path, f"images[{i}]", image, {"id": int, "file_name": str, "width": int, "height": int})
        if image["width"] < 1 or image["height"] < 1:
            raise UsageError(f"{path}: images[{i}]: width and height must be >= 1, "
                             f"got {image['width']}x{image['height']}")
    for i, ann in enumerate(doc["annotations"]):
        _check_record(path, f"annotations[{i}]", ann, {"id": int, "image_id": int, "category_id": int, "bbox": list})
        bbox = ann["bbox"]
        if len(bbox) != 4 or not all(_is_number(v) for v in bbox):
            raise UsageError(f"{path}: annotations[{i}].bbox: expected 4 numbers [x, y, width, height], got {bbox!r}")
        if ann.get("iscrowd", 0) not in (0, 1, True, False):
            raise UsageError(f"{path}: annotations[{i}].iscrowd: expected 0 or 1, got {ann['iscrowd']!r}")
    seen = {}
    for i, cat in enumerate(doc["categories"]):
        _check_record(path, f"categories[{i}]", cat, {"id": int, "name": str})
        if cat["id"] in seen:
            raise UsageError(f"{path}: categories[{i}].id {cat['id']} repeats categories[{seen[cat['id']]}]")
        seen[cat["id"]] = i
    if not doc["categories"]:
        raise UsageError(f"{path}: 'categories' is empty")
    return doc


def _check_record(path: Path, where: str, record, fields: dict) -> None:
    if not isinstance(record, dict):
        raise UsageError(f"{path}: {where} must be an object, got {_type(record)}")
    for key, kind in fields.items():
        if key not in record:
            raise UsageError(f"{path}: {where}: missing key '{key}'")
        value = record[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UsageError(f"{path}: {where}.{key} must be {kind.__name__}, got {_type(value)} {value!r}"[:300])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def _type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def sorted_categories(categories: list[dict]) -> list[dict]:
    """The training order: by category id, whatever the ids (0-based, 1-based, sparse like COCO's 1..90)."""
    return sorted(categories, key=lambda c: c["id"])


# ----------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Item:
    """One image record with its annotations, as the worker needs it."""

    split: str
    folder: str  # the split's --images folder
    record: dict
    annotations: tuple  # as given, valid image and category, first of any repeated id
    labels: tuple  # training index of each annotation's category
    problem: str | None = None  # why its file cannot be read (a broken symlink, a FIFO, ...): its skip reason

    @property
    def file_name(self) -> str:
        return self.record["file_name"]


@dataclass
class SplitPlan:
    items: list[Item]
    skipped: list[dict]  # image records not converted
    skipped_annotations: list[dict]  # annotations not attached to any sample
    entries: list[tuple[str, int]]  # (file_name, size) of the files converted, for the listing
    fingerprint_lines: list[str]
    source_bytes: int
    other_keys: dict  # the instances file's keys besides images/annotations/categories (info, licenses)


def plan_split(split: str, folder: Path, doc: dict, index_of: dict[int, int], *, skip_empty: bool,
               seed: int) -> SplitPlan:
    """Index annotations by image once (COCO train2017 has 860k), account for every record, and order the
    images with the seed. dali-bench's baseline reads the same items."""
    records, skipped, skipped_anns = {}, [], []
    for position, record in enumerate(doc["images"]):
        if record["id"] in records:
            skipped.append({"path": record["file_name"], "image_id": record["id"], "split": split,
                            "reason": f"duplicate image id {record['id']} (images[{position}]; the first is kept)"})
            continue
        records[record["id"]] = record

    by_image, first_seen = defaultdict(list), {}
    for ann in doc["annotations"]:
        problem = None
        if ann["id"] in first_seen:
            problem = f"duplicate annotation id (first on image {first_seen[ann['id']]}; the first is kept)"
        elif ann["image_id"] not in records:
            problem = f"image_id {ann['image_id']} has no image record"
        elif ann["category_id"] not in index_of:
            problem = f"category_id {ann['category_id']} is not in categories"
        if problem:
            skipped_anns.append({"annotation_id": ann["id"], "image_id": ann["image_id"], "split": split,
                                 "reason": problem})
            continue
        first_seen[ann["id"]] = ann["image_id"]
        by_image[ann["image_id"]].append(ann)

    items, entries, lines, total = [], [], [], 0
    for image_id in sorted(records):
        record, anns = records[image_id], by_image.get(image_id, [])
        path = folder / record["file_name"]
        try:
            os.lstat(path)
        except OSError as e:  # a record of an image not downloaded: skipped, whatever --on-error says
            skipped.append({"path": record["file_name"], "image_id": image_id, "split": split,
                            "reason": f"missing: {e.strerror or e} ({len(anns)} annotations not converted)"})
            continue
        if skip_empty and not anns:
            skipped.append({"path": record["file_name"], "image_id": image_id, "split": split,
                            "reason": "no annotations (--skip-empty)"})
            continue
        st = stat_source(path)  # a broken symlink, a loop, a FIFO: an item the worker skips, naming why
        problem = f"{st.problem} ({len(anns)} annotations not converted)" if st.problem else None
        items.append(Item(split, str(folder), record, tuple(anns), tuple(index_of[a["category_id"]] for a in anns),
                          problem))
        entries.append((record["file_name"], st.size))
        marker = f"\0{problem}" if problem else ""
        lines.append(f"{split}\0{record['file_name']}\0{st.size}\0{st.mtime_ns}{marker}\n")
        total += st.size
    random.Random(f"{seed}:{split}").shuffle(items)
    other = {k: v for k, v in doc.items() if k not in REQUIRED_KEYS}
    return SplitPlan(items, skipped, skipped_anns, entries, lines, total, other)


def build_plan(cfg: CocoConfig) -> Plan:
    cfg.validate()
    docs = [load_instances(path) for path in cfg.annotations]
    categories = sorted_categories(docs[0]["categories"])
    for path, doc in zip(cfg.annotations[1:], docs[1:]):
        if sorted_categories(doc["categories"]) != categories:
            raise UsageError(f"{path}: categories differ from {cfg.annotations[0]}'s: the splits of one shard "
                             f"folder share one set of categories")
    index_of = {c["id"]: i for i, c in enumerate(categories)}

    splits, skipped, skipped_anns, listings, source_bytes = {}, [], [], {}, 0
    fingerprint = hashlib.sha256()
    coco_splits = {}
    for split, folder, path, doc in zip(cfg.split, cfg.images, cfg.annotations, docs):
        part = plan_split(split, folder, doc, index_of, skip_empty=cfg.skip_empty, seed=cfg.seed)
        splits[split] = part.items
        skipped += part.skipped
        skipped_anns += part.skipped_annotations
        listings[split] = listing_digest(part.entries)
        source_bytes += part.source_bytes
        st = path.stat()
        fingerprint.update(f"{split}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        fingerprint.update("".join(part.fingerprint_lines).encode())
        coco_splits[split] = {"images": str(folder.resolve()), "annotations": str(path.resolve()),
                              "image_records": len(doc["images"]), "annotations_given": len(doc["annotations"]),
                              "other_keys": part.other_keys}
    source = "; ".join(f"{s}: {f.resolve()} + {a.resolve()}" for s, f, a in zip(cfg.split, cfg.images, cfg.annotations))
    warnings = [f"{a['split']}: annotation {a['annotation_id']} not converted: {a['reason']}" for a in skipped_anns]
    return Plan(
        kind="coco", source=source, splits=splits, classes=[c["name"] for c in categories],
        encode=functools.partial(encode_item, quality=cfg.jpeg_quality, max_side=cfg.max_side,
                                 max_pixels=cfg.max_pixels),
        describe=describe_item,
        fingerprint={"kind": "coco", "source": source, "options": cfg.output_options(),
                     "listing_sha256": fingerprint.hexdigest()},
        listings=listings, skipped=skipped, found=sum(len(d["images"]) for d in docs), warnings=warnings,
        extra={"coco": {"categories": docs[0]["categories"], "category_ids": [c["id"] for c in categories],
                        "splits": coco_splits, "skipped_annotations": skipped_anns}},
        counts={"annotations_not_converted": len(skipped_anns)},
        source_bytes=source_bytes,
    )


def convert_coco(cfg: CocoConfig) -> ShardManifest:
    """Convert COCO splits to shards in `cfg.out`, as `shard-convert coco` does.

    An interrupted conversion of the same input and options continues where it stopped; the manifest is
    written last. Call it under `if __name__ == "__main__":` in a script: the workers start by importing it.

    Args:
        cfg: The image folders, instances files, output folder and the conversion's options.

    Returns:
        The written folder's manifest (kind `"coco"`, the categories kept), with `summary` (a
        `ConvertSummary`) attached.

    Raises:
        UsageError: An option is out of range, a folder or instances file is missing, or an instances file
            is not COCO's.
        ConversionFailed: With `on_error="fail"`, the first image that cannot be read.
        FolderInUse: Another conversion holds `out`'s lock.
        DiskFull: The disk filled up; the message says how much more is needed.

    Example:
        ```python
        from dalifeed.convert import CocoConfig, convert_coco

        if __name__ == "__main__":
            manifest = convert_coco(CocoConfig(images=["coco/val2017"], out="/data/coco-val",
                                               annotations=["coco/annotations/instances_val2017.json"]))
            print(manifest.summary.samples, "images")
        ```
    """
    return convert(build_plan(cfg), cfg, "shard-convert coco")


def describe_item(item: Item) -> str:
    return f"{item.split}/{item.file_name}"


# ----------------------------------------------------------------------------------------------------
# one image (in a worker)


def encode_item(item: Item, quality: int, max_side: int | None, max_pixels: int) -> Sample | Skip:
    """Worker: the image (checked, passed through or re-encoded) and its annotations as tar members."""
    if item.problem:  # found while planning; a FIFO must not even be opened (reading it blocks)
        return Skip(item.problem)
    path = Path(item.folder, item.file_name)
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skip(f"unreadable: {e.strerror or e} ({len(item.annotations)} annotations not converted)")
    record = item.record
    try:
        image = to_jpeg(data, quality, max_side, max_pixels,
                        apply_orientation=functools.partial(annotations_are_upright, record))
    except ImageError as e:
        return Skip(f"{e} ({len(item.annotations)} annotations not converted)")
    warnings = []
    scale_w, scale_h = image.width / record["width"], image.height / record["height"]
    if image.reencoded == "max_side":  # shrunk: the aspect ratio must still be the record's
        mismatch = abs(scale_w - scale_h) > 0.01 * max(scale_w, scale_h)
    else:
        mismatch = (image.width, image.height) != (record["width"], record["height"])
    if mismatch:
        warnings.append(f"{describe_item(item)}: the image record says {record['width']}x{record['height']}, the "
                        f"file is {image.width}x{image.height}; boxes are kept relative to the record's size")
    boxes, crowd, counts = training_boxes(item, warnings)
    members = [
        (IMAGE_MEMBER, SourceFile(str(path), len(data)) if image.reencoded is None else image.jpeg),
        (META_MEMBER, sample_json(record, item.annotations, image.reencoded)),
        (COCO_BOXES_MEMBER, np.asarray([b for b, _ in boxes], dtype="<f4").reshape(-1, 4).tobytes()),
        (COCO_LABELS_MEMBER, np.asarray([label for _, label in boxes], dtype="<i4").tobytes()),
        (COCO_CROWD_BOXES_MEMBER, np.asarray([b for b, _ in crowd], dtype="<f4").reshape(-1, 4).tobytes()),
        (COCO_CROWD_LABELS_MEMBER, np.asarray([label for _, label in crowd], dtype="<i4").tobytes()),
        (COCO_ID_MEMBER, struct.pack("<q", record["id"])),
    ]
    counts["images_without_boxes"] = int(not boxes)
    return Sample(members, image.reencoded, classes=tuple(label for _, label in boxes), warnings=warnings,
                  counts=counts)


def sample_json(record: dict, annotations, reencoded: str | None) -> bytes:
    """A sample's `.json` (`format.COCO_META`): the record's typed fields (load_instances checked their types)
    and the record and annotations as given, as JSON text."""
    compact = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))
    doc = {"image_id": record["id"], "file_name": record["file_name"], "width": record["width"],
           "height": record["height"], "reencoded": reencoded or "", "image_json": compact(record),
           "annotations_json": compact(list(annotations))}
    return compact(doc).encode()


def parse_sample_json(data: bytes) -> tuple[dict, list[dict]]:
    """(the image record, its annotations), as given, from a sample's `.json`. ValueError when it is not one
    this format writes (`meta_problems`) or its fields disagree with the record."""
    doc = json.loads(data)
    problems = meta_problems(doc, COCO_META)
    if problems:
        raise ValueError(f".json {problems[0]}")
    record, annotations = json.loads(doc["image_json"]), json.loads(doc["annotations_json"])
    if not isinstance(record, dict) or not isinstance(annotations, list):
        raise ValueError(".json: image_json must be an object and annotations_json a list")
    lifted = {"image_id": "id", "file_name": "file_name", "width": "width", "height": "height"}
    for key, name in lifted.items():
        if doc[key] != record.get(name):
            raise ValueError(f".json: {key} is {doc[key]!r}, its image_json says {name} {record.get(name)!r}")
    return record, annotations


def annotations_are_upright(record: dict, orientation: int, width: int, height: int) -> bool:
    """For an EXIF-rotated image stored `width` x `height`: whether the record's boxes are in the rotated
    (displayed) frame rather than the stored pixel frame. COCO's own tools read the stored frame; only a
    record whose width/height are the stored ones swapped says otherwise."""
    return (orientation in SWAPPING_ORIENTATIONS and width != height
            and (record["width"], record["height"]) == (height, width))


def training_boxes(item: Item, warnings: list[str]) -> tuple[list, list, dict]:
    """The annotations' boxes as training targets: relative x0 y0 x1 y1 clipped to the image, (box, label)
    pairs for non-crowd and crowd annotations. A box of no area inside the image is left out (and reported);
    the annotation itself stays in the sample's json."""
    width, height = item.record["width"], item.record["height"]
    boxes, crowd = [], []
    counts = {"boxes": 0, "crowd_boxes": 0, "boxes_clipped": 0, "boxes_dropped": 0}
    for ann, label in zip(item.annotations, item.labels):
        x, y, w, h = (float(v) for v in ann["bbox"])
        x0, y0, x1, y1 = max(0.0, x), max(0.0, y), min(float(width), x + w), min(float(height), y + h)
        if w <= 0 or h <= 0 or x1 <= x0 or y1 <= y0:
            counts["boxes_dropped"] += 1
            why = "has no area" if w <= 0 or h <= 0 else f"lies outside the {width}x{height} image"
            warnings.append(f"{describe_item(item)}: annotation {ann['id']} bbox {ann['bbox']} {why}: not a training "
                            f"target (kept in the sample's json)")
            continue
        if (x0, y0, x1, y1) != (x, y, x + w, y + h):
            counts["boxes_clipped"] += 1
        box = (x0 / width, y0 / height, x1 / width, y1 / height)
        if ann.get("iscrowd", 0):
            crowd.append((box, label))
            counts["crowd_boxes"] += 1
        else:
            boxes.append((box, label))
            counts["boxes"] += 1
    return boxes, crowd, counts


def check_coco_sample(where: str, members: dict[str, bytes], index_of: dict[int, int]) -> list[str]:
    """A COCO sample (for verify): every member there, the binary boxes, labels and id exactly what the .json
    gives under the conversion's rules, labels within range."""
    missing = [ext for ext in COCO_MEMBERS if ext not in members]
    if missing:
        return [f"{where}: missing {', '.join('.' + m for m in missing)}"]
    try:
        record, annotations = parse_sample_json(members[META_MEMBER])
        image_id = struct.unpack("<q", members[COCO_ID_MEMBER])[0]
        binary = {name: np.frombuffer(members[name], dtype) for name, dtype in
                  ((COCO_BOXES_MEMBER, "<f4"), (COCO_LABELS_MEMBER, "<i4"), (COCO_CROWD_BOXES_MEMBER, "<f4"),
                   (COCO_CROWD_LABELS_MEMBER, "<i4"))}
    except (ValueError, KeyError, TypeError, struct.error) as e:
        return [f"{where}: unreadable .json, .{COCO_ID_MEMBER} or box members ({e})"]
    problems = []
    if image_id != record.get("id"):
        problems.append(f"{where}: .{COCO_ID_MEMBER} is {image_id}, the .json's image id is {record.get('id')}")
    for name in (COCO_LABELS_MEMBER, COCO_CROWD_LABELS_MEMBER):
        labels = binary[name]
        if labels.size and not (0 <= labels.min() and labels.max() < len(index_of)):
            problems.append(f"{where}: .{name} {labels.tolist()} outside 0..{len(index_of) - 1}")
    unknown = [a.get("category_id") for a in annotations if a.get("category_id") not in index_of]
    if unknown:
        return problems + [f"{where}: .json has category ids {unknown} that are not in the manifest's categories"]
    item = Item("", "", record, tuple(annotations), tuple(index_of[a["category_id"]] for a in annotations))
    boxes, crowd, _ = training_boxes(item, [])
    expected = {COCO_BOXES_MEMBER: np.asarray([b for b, _ in boxes], "<f4").reshape(-1),
                COCO_LABELS_MEMBER: [lb for _, lb in boxes],
                COCO_CROWD_BOXES_MEMBER: np.asarray([b for b, _ in crowd], "<f4").reshape(-1),
                COCO_CROWD_LABELS_MEMBER: [lb for _, lb in crowd]}
    for name, want in expected.items():
        if not np.array_equal(binary[name], np.asarray(want, binary[name].dtype)):
            problems.append(f"{where}: .{name} disagrees with the annotations in .json")
    return problems


# ----------------------------------------------------------------------------------------------------
# shards -> instances file


class ExportError(Exception):
    """COCO shards that cannot be exported as asked: one line naming the folder and why."""


def export_coco(shards: str | os.PathLike, split: str | None = None) -> dict:
    """The instances file of one split, rebuilt from COCO shards: what pycocotools loads as it loaded the
    original, minus the images the conversion listed as skipped.

    Args:
        shards: A shard folder made by `convert_coco`: a local path or `s3://bucket/prefix` (each tar streamed
            once).
        split: The split to export; None: the folder's only split. Default None.

    Returns:
        The instances document (`images`, `annotations`, `categories` and the other top-level keys the
        original had), ready for `json.dump`.

    Raises:
        ExportError: The folder was not made from COCO, or it has several splits and `split` is None.
        ManifestError: No finished shard folder at `shards`, or it lacks `split`.
    """
    manifest = open_shard_folder(shards)
    where = manifest.location
    if manifest.kind != "coco":
        raise ExportError(f"{where}: made from {manifest.kind}, not COCO: nothing to export")
    if split is None:
        if len(manifest.splits) != 1:
            raise ExportError(f"{where}: has splits {', '.join(manifest.splits)}: choose one with --split")
        split = next(iter(manifest.splits))
    manifest.split_info(split)  # a split it does not have: ManifestError, before any tar is read
    coco = manifest.extra["coco"]
    images, annotations = [], []
    try:
        for sample in read_samples(manifest, split, members={META_MEMBER}):
            try:
                record, anns = parse_sample_json(sample[META_MEMBER])
            except (KeyError, ValueError) as e:
                raise ExportError(f"{sample['__url__']}: sample {sample['__key__']}: unreadable .json ({e}); "
                                  f"shard-convert verify {where} checks every sample") from None
            images.append(record)
            annotations += anns
    except tarfile.TarError as e:
        raise ExportError(f"{e}; shard-convert verify {where} checks every shard") from None
    images.sort(key=lambda r: r["id"])
    annotations.sort(key=lambda a: a["id"])
    return {**coco["splits"][split].get("other_keys", {}), "images": images, "annotations": annotations,
            "categories": coco["categories"]}
