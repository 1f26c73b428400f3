"""Do `--imagefolder` and `--shards` hold the same images? A race between loaders reading different data
measures nothing: other image sizes or counts make a "speed-up" an artefact."""

from __future__ import annotations

from pathlib import Path

from dalifeed.convert.imagefolder import find_classes, list_class_files
from dalifeed.format import ShardManifest, listing_digest
from dalifeed.runtime import mib


def imagefolder_listing(folder: Path) -> tuple[list[str], dict]:
    """The classes of an ImageFolder tree and the digest of its files, as shard-convert records them."""
    classes = find_classes(folder)
    items, _ = list_class_files(folder, folder, classes)
    return classes, listing_digest((item.relpath, item.size) for item in items)


def same_data_problem(imagefolder: Path, manifest: ShardManifest, split: str) -> str | None:
    """None when `imagefolder` holds exactly the files that `split` of the shards was made from (or, for
    splits carved from one tree by --val-fraction, the whole tree); else what differs, in one sentence."""
    classes, mine = imagefolder_listing(imagefolder)
    made_from = manifest.splits[split].listing
    if made_from is None:  # a manifest from before listings were recorded: compare what it has
        if classes != manifest.classes:
            return f"--imagefolder has classes {_few(classes)}, --shards {_few(manifest.classes)}"
        return None
    if mine in (made_from, manifest.extra.get("source_listing")):
        return None
    parts = [f"--imagefolder {imagefolder} holds {mine['files']} files ({mib(mine['bytes'])}) in {len(classes)} "
             f"classes, --shards split {split!r} was made from {made_from['files']} files ({mib(made_from['bytes'])}) "
             f"of {manifest.source} in {len(manifest.classes)} classes"]
    if classes != manifest.classes:
        parts.append(f"the class names differ ({_few(classes)} against {_few(manifest.classes)})")
    elif mine["files"] == made_from["files"]:
        parts.append("the same number of files, but other names or sizes")
    return "; ".join(parts)


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
