"""A TensorFlow Datasets folder, read without TensorFlow: what `tfds.builder(...).download_and_prepare()`
writes (docs/format.md#tfrecord-input).

TFDS names its record files `<dataset>-<split>.tfrecord-NNNNN-of-NNNNN` and writes beside them
`dataset_info.json` (the splits, with the records in each file: `shardLengths`), `features.json` (each
feature's class: `Image`, `ClassLabel` with `numClasses`, ...) and `<feature>.labels.txt` (a ClassLabel's
names, one a line, in label order). This module reads those: which split a file is, which features hold the
image and the label (the one Image and ClassLabel feature, or among several the one `supervisedKeys` names),
the class names, and the records each file should hold.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .options import UsageError
from .shards import ConversionFailed

TFDS_FILE = re.compile(r"(?P<dataset>[^-/]+)-(?P<split>[^./]+)\.tfrecord-(?P<shard>\d+)-of-(?P<shards>\d+)")
DATASET_INFO, FEATURES = "dataset_info.json", "features.json"
LABELS_SUFFIX = ".labels.txt"
OTHER_METADATA = ("LICENSE", "metadata.json")  # DatasetInfo.write_to_directory's license and tfds.core.MetadataDict


def is_metadata(name: str) -> bool:
    """Whether a file name is one of the metadata files TFDS writes beside its records."""
    return name in (DATASET_INFO, FEATURES, *OTHER_METADATA) or name.endswith(LABELS_SUFFIX)


def tfds_name(name: str) -> tuple[str, int, int] | None:
    """(split as TFDS names it, shard index, shard count) of a file TFDS named, else None."""
    match = TFDS_FILE.fullmatch(name)
    if match is None:
        return None
    return match["split"], int(match["shard"]), int(match["shards"])


@dataclass
class TfdsInfo:
    """What a TFDS folder's metadata files say (each part empty where its file is absent)."""

    folder: Path
    files: list[str] = field(default_factory=list)  # the metadata files read, relative to the folder
    kinds: dict[str, str] = field(default_factory=dict)  # feature name (as in the records) -> its class (Image)
    num_classes: dict[str, int] = field(default_factory=dict)  # ClassLabel feature -> numClasses
    shard_lengths: dict[str, list[int]] = field(default_factory=dict)  # TFDS split name -> records per file
    supervised: tuple[str, ...] = ()  # the features dataset_info.json's supervisedKeys names: (image, label)

    def the_feature(self, kind: str, flag: str) -> str:
        """The feature of this class (Image, ClassLabel): the only one, or among several the one supervisedKeys
        names (cifar100's label, not coarse_label; oxford_iiit_pet's image, not segmentation_mask). Refused
        (`UsageError`, naming `flag`) when there is none or that does not tell one."""
        names = [name for name, k in self.kinds.items() if k == kind]
        chosen = names if len(names) == 1 else [name for name in names if name in self.supervised]
        if len(chosen) == 1:
            return chosen[0]
        if not names:
            raise UsageError(f"{self.folder / FEATURES}: no {kind} feature (its features: "
                             f"{', '.join(self.kinds)}): give {flag} NAME")
        raise UsageError(f"{self.folder / FEATURES}: {len(names)} {kind} features ({', '.join(names)}) and "
                         f"{DATASET_INFO}'s supervisedKeys names {'both' if len(chosen) > 1 else 'none'}: "
                         f"give {flag} NAME")

    def class_names(self, feature: str) -> tuple[list[str], str] | None:
        """A ClassLabel feature's names and the file they come from: `<feature>.labels.txt` (a nested
        feature's '/' written as '-', as TFDS does), else numClasses' "0".."N-1"; None if neither says."""
        path = self.folder / f"{feature.replace('/', '-')}{LABELS_SUFFIX}"
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ConversionFailed(f"{path}: unreadable class names ({e})") from None
            names = [line.strip() for line in text.split("\n") if line.strip()]
            if len(set(names)) != len(names):
                raise ConversionFailed(f"{path}: a class name is there twice")
            if feature in self.num_classes and self.num_classes[feature] != len(names):
                raise ConversionFailed(f"{path}: {len(names)} names, but {FEATURES} says {feature} has "
                                       f"{self.num_classes[feature]} classes")
            return names, path.name
        if feature in self.num_classes:
            return [str(i) for i in range(self.num_classes[feature])], FEATURES
        return None


def read_tfds(folder: Path) -> TfdsInfo | None:
    """The metadata of the TFDS folder `folder`, or None when it holds none of TFDS's metadata files."""
    info = TfdsInfo(folder)
    features = _json(folder / FEATURES)
    if features is not None:
        info.files.append(FEATURES)
        _read_features(features, "", info)
    dataset = _json(folder / DATASET_INFO)
    if dataset is not None:
        info.files.append(DATASET_INFO)
        for split in dataset.get("splits", []) if isinstance(dataset, dict) else []:
            lengths = split.get("shardLengths") if isinstance(split, dict) else None
            if isinstance(lengths, list) and split.get("name"):
                info.shard_lengths[str(split["name"])] = [int(n) for n in lengths]
        info.supervised = _supervised_keys(dataset.get("supervisedKeys") if isinstance(dataset, dict) else None)
    info.files += sorted(p.name for p in folder.glob(f"*{LABELS_SUFFIX}"))
    info.files += [name for name in OTHER_METADATA if info.files and (folder / name).is_file()]
    return info if info.files else None


def check_file_format(folder: Path) -> None:
    """Refuse (`UsageError`) a TFDS folder whose dataset_info.json says its records are in another format
    (array_record, riegeli, parquet) and not also in TFRecord files (`alternativeFileFormats`)."""
    info = _json(folder / DATASET_INFO) if folder.is_dir() else None
    if not isinstance(info, dict):
        return
    formats = [info.get("fileFormat") or "tfrecord", *info.get("alternativeFileFormats", [])]
    if "tfrecord" not in formats:
        raise UsageError(f"{folder / DATASET_INFO}: the records are {formats[0]} files, not TFRecord: prepare the "
                         f"dataset with download_and_prepare(file_format='tfrecord')")


def _json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConversionFailed(f"{path}: not TensorFlow Datasets' JSON ({e})") from None


def _supervised_keys(keys) -> tuple[str, ...]:
    """The feature names of a SupervisedKeys message as JSON: `{"input": .., "output": ..}` (older TFDS),
    or `{"tuple": {"items": [{"featureKey": ..}, ..]}}`; nested dicts and tuples of keys are not read."""
    if not isinstance(keys, dict):
        return ()
    if keys.get("input") or keys.get("output"):
        return tuple(str(keys[k]) for k in ("input", "output") if keys.get(k))
    items = keys.get("tuple", {}).get("items", []) if isinstance(keys.get("tuple"), dict) else []
    return tuple(str(item["featureKey"]) for item in items if isinstance(item, dict) and "featureKey" in item)


def _read_features(feature: dict, prefix: str, info: TfdsInfo) -> None:
    """features.json as FeatureConnector.save_config writes it (the Feature proto as JSON): a FeaturesDict's
    children under "featuresDict"/"features", nested ones flattened with '/' as in the records. Also the
    form older TFDS wrote, before the proto: `{"type": <class>, "content": ...}`."""
    if not isinstance(feature, dict):
        return
    if isinstance(feature.get("type"), str):  # older TFDS
        kind, content = feature["type"].rsplit(".", 1)[-1], feature.get("content")
        children = content if kind == "FeaturesDict" else None
        classes = content.get("num_classes") if kind == "ClassLabel" and isinstance(content, dict) else None
        classes = classes if isinstance(classes, int) else None
    else:
        children = feature.get("featuresDict", {}).get("features")
        kind = str(feature.get("pythonClassName", "")).rsplit(".", 1)[-1]
        label = feature.get("classLabel")
        classes = label.get("numClasses") if isinstance(label, dict) else None
    if isinstance(children, dict):
        for name, child in children.items():
            _read_features(child, f"{prefix}{name}/", info)
        return
    name = prefix.rstrip("/")
    if not name:
        return
    info.kinds[name] = kind
    if classes is not None:
        info.num_classes[name] = int(classes)


def count_warnings(info: TfdsInfo, counted: dict[str, tuple[str, int, int, int]]) -> list[str]:
    """Where the records found differ from dataset_info.json's shardLengths: a file holding another number,
    a file of a split missing. `counted` maps a file (relative path) to (TFDS split, shard, shards, records)."""
    warnings = []
    seen: dict[str, set[int]] = {}
    for relpath, (split, shard, shards, records) in sorted(counted.items()):
        lengths = info.shard_lengths.get(split)
        seen.setdefault(split, set()).add(shard)
        if lengths is None:
            continue
        if len(lengths) != shards or shard >= shards:
            warnings.append(f"{relpath}: shard {shard} of {shards}, but {DATASET_INFO} gives split {split} "
                            f"{len(lengths)} files")
        elif lengths[shard] != records:
            warnings.append(f"{relpath}: {records} records, {DATASET_INFO} says {lengths[shard]}")
    for split, lengths in info.shard_lengths.items():
        missing = [i for i in range(len(lengths)) if i not in seen.get(split, set())]
        if split in seen and missing:
            warnings.append(f"split {split}: {len(missing)} of its {len(lengths)} files are not here (shards "
                            f"{', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}; "
                            f"{sum(lengths[i] for i in missing)} records per {DATASET_INFO})")
    return warnings
