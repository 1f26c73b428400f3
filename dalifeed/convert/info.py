"""`shard-convert info`: what a shard folder holds, read from its manifest alone (no tar is opened)."""

from __future__ import annotations

from collections import Counter

from ..format import ShardManifest
from ..shardfolder import missing_indexes


def folder_info(manifest: ShardManifest) -> dict:
    """A JSON-ready summary of `manifest`: per split, samples, shards, bytes, per-class counts and whether
    the index files are there (on disk, or a HEAD each in a store); re-encoded and skipped counts by reason;
    warnings; source and options. `folder` is where it is: its path or s3:// URL."""
    splits = {}
    for name, split in manifest.splits.items():
        counts = split.class_counts
        missing = missing_indexes(manifest, name)
        splits[name] = {
            "samples": split.samples, "shards": len(split.shards), "bytes": split.bytes,
            "class_counts": dict(zip(manifest.classes, counts)) if counts is not None else None,
            "indexes_missing": missing,
        }
    skipped = Counter(entry["reason"].split(":")[0] for entry in manifest.skipped)
    return {
        "folder": manifest.location, "kind": manifest.kind, "source": manifest.source,
        "options": options_used(manifest), "found": manifest.found, "classes": len(manifest.classes), "splits": splits,
        "reencoded": manifest.reencoded.get("by_reason", {}), "skipped": dict(sorted(skipped.items())),
        "warnings": manifest.warnings, "counts": manifest.extra.get("counts", {}),
        "category_ids": manifest.extra.get("coco", {}).get("category_ids"),
        "split_folders": manifest.extra.get("split_folders"),
        "tars": str(manifest.tar_root) if manifest.tar_root is not None else None,
    }


def options_used(manifest: ShardManifest) -> dict:
    """The options a folder was made with, the features a TFRecord conversion read in place of those given
    (a TensorFlow Datasets folder's `image` and `label` for the defaults, which its features.json lacks)."""
    used = manifest.extra.get("tfrecord", {}) if manifest.kind == "tfrecord" else {}
    return {k: used.get(k, v) if k in ("image_feature", "label_feature") else v for k, v in manifest.options.items()}


def describe_folder(info: dict) -> str:
    options = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in info["options"].items() if v is not None)
    lines = [f"{info['folder']}: {info['kind']} shards of {info['source']}", f"  made with: {options}"]
    if info.get("tars"):
        lines.append(f"  tars: in {info['tars']} (the indexes and manifest here)")
    for name, split in info["splits"].items():
        indexes = "all present" if not split["indexes_missing"] else \
            f"{len(split['indexes_missing'])} MISSING (e.g. {split['indexes_missing'][0]})"
        folder = (info.get("split_folders") or {}).get(name)
        made_from = f"; from {folder}/" if folder not in (None, ".") else ""
        lines.append(f"  {name}: {split['samples']} samples in {split['shards']} shards, "
                     f"{split['bytes'] / 2**20:,.1f} MiB; DALI indexes {indexes}{made_from}")
        counts = split["class_counts"]
        if counts:
            total = sum(counts.values()) or 1
            low, high = min(counts.values()), max(counts.values())
            shown = ", ".join(f"{cls} {n} ({n / total:.1%})" for cls, n in list(counts.items())[:12])
            more = f", ... ({len(counts) - 12} more)" if len(counts) > 12 else ""
            lines.append(f"    classes: {shown}{more}; per class {low}..{high}")
        elif counts is None:
            lines.append("    classes: counts not recorded (made by an older dalifeed)")
    converted = sum(s["samples"] for s in info["splits"].values())
    found = {"coco": "image records", "webdataset": "samples found", "tfrecord": "records found"}.get(info["kind"],
                                                                                                   "files found")
    done, skipped = ("indexed", "left out") if info["kind"] == "webdataset" else ("converted", "skipped")
    lines.append(f"  {found} {info['found']}: {converted} {done}, {sum(info['skipped'].values())} {skipped}")
    if info.get("category_ids"):
        lines.append(f"  categories: ids {info['category_ids'][:12]}{' ...' if len(info['category_ids']) > 12 else ''}"
                     f" are training indices 0..{len(info['category_ids']) - 1} (class counts: images holding one)")
    for title, counts in (("re-encoded", info["reencoded"]), ("skipped", info["skipped"]),
                          ("counts", info.get("counts", {}))):
        if counts:
            lines.append(f"  {title}: " + ", ".join(f"{reason} {n}" for reason, n in counts.items()))
    for warning in info["warnings"]:
        lines.append(f"  warning: {warning}")
    return "\n".join(lines)
