"""Classes and labels of `shard-convert tfrecord`, from what the listing pass read of every record.

With synsets (ImageNet's `image/class/synset`), the classes are the sorted synsets present (torchvision
ImageFolder's order), or every synset of `--synsets-file`, and the records' own labels must be those indices
shifted by one constant. Without, the classes are the label feature's values (plus `--label-offset`), named by a
TensorFlow Datasets `<feature>.labels.txt` where there is one. A class no record has is said by its name or
label, with the damaged records that carried it; it never silently moves every other label.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .shards import ConversionFailed


@dataclass
class Labelling:
    """The classes, and how a record's features become a class index."""

    classes: list[str]
    label_offset: int | None  # what the file's labels were shifted by to be class indices (None: no labels seen)
    by_synset: bool
    source: str  # where the class names come from: the synset or label feature, or a file
    warnings: list[str] = field(default_factory=list)
    index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {name: i for i, name in enumerate(self.classes)}


def read_synsets(path: Path) -> list[str]:
    """--synsets-file: the first word of each non-empty line (imagenet_lsvrc_2015_synsets.txt's synsets, or
    LOC_synset_mapping.txt's `n01440764 tench, Tinca tinca`), in the file's order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionFailed(f"--synsets-file {path}: unreadable ({e})") from None
    synsets = [line.split()[0] for line in lines if line.strip()]
    twice = next((s for i, s in enumerate(synsets) if s in synsets[:i]), None)
    if not synsets or twice:
        raise ConversionFailed(f"--synsets-file {path}: " + (f"synset {twice} is there twice" if twice else "empty"))
    return synsets


def label_records(found: dict, cfg, label_feature: str, names: tuple[list[str], str] | None) -> Labelling:
    """The classes and how each record is labelled; `found` maps each file to its listed records, `names` is
    a TFDS ClassLabel's names and the file they came from."""
    good = [r for records in found.values() for r in records if r.problem is None]
    if cfg.synset_feature and any(r.synset is not None for r in good):
        return by_synset(found, good, cfg, label_feature)
    offset = cfg.label_offset or 0
    labels = {r.label + offset for r in good if r.label is not None}
    if names is not None:
        classes, source = names
    else:
        top = max((v for v in labels if v >= 0), default=-1)
        classes, source = [str(i) for i in range(top + 1)], label_feature
    absent = [i for i in range(len(classes)) if i not in labels]
    warnings = []
    if absent and labels:
        said = ", ".join(classes[i] if names is None else f"{classes[i]} ({label_feature} {i - offset})"
                         for i in absent[:10])
        warnings.append(f"{len(absent)} of the {len(classes)} classes have no record: {said}"
                        f"{', ...' if len(absent) > 10 else ''}{damaged(found, {i - offset for i in absent}, set())}")
    return Labelling(classes, offset, False, source, warnings)


def by_synset(found: dict, good: list, cfg, label_feature: str) -> Labelling:
    present = sorted({r.synset for r in good if r.synset is not None})
    classes = read_synsets(cfg.synsets_file) if cfg.synsets_file is not None else present
    index = {name: i for i, name in enumerate(classes)}
    label_of: dict[str, tuple[int, str]] = {}  # synset -> the label of its first record, and where that is
    for where, records in found.items():
        for r in records:
            if r.problem is not None or r.synset is None:
                continue
            if r.synset not in index:
                raise ConversionFailed(f"{where} record {r.number}: synset {r.synset} is not in --synsets-file "
                                       f"{cfg.synsets_file}")
            if r.label is None:
                continue
            first = label_of.setdefault(r.synset, (r.label, f"{where} record {r.number}"))
            if first[0] != r.label:
                raise ConversionFailed(f"{where} record {r.number}: {label_feature} {r.label} for synset {r.synset}, "
                                       f"which {first[1]} labels {first[0]}: one synset, two labels")
    ordered = sorted(label_of, key=index.__getitem__)
    warnings: list[str] = []
    offsets = {s: label_of[s][0] - index[s] for s in ordered}
    offset = offsets[ordered[0]] if ordered else None
    if offset is not None and cfg.synsets_file is None:
        labels = [label_of[s][0] for s in ordered]
        gaps = sorted(set(range(labels[0], labels[-1] + 1)) - set(labels))
        if gaps and labels == sorted(labels) and len(set(labels)) == len(labels):
            raise ConversionFailed(
                f"classes missing: no record has {label_feature} {', '.join(map(str, gaps[:10]))}"
                f"{', ...' if len(gaps) > 10 else ''} (the labels go {labels[0]}..{labels[-1]} over "
                f"{len(labels)} synsets){damaged(found, set(gaps), set(present))}; the classes are the synsets "
                f"present, so every label after a gap would move: give --synsets-file FILE (every synset, one a "
                f"line: an absent class keeps its index), or --synset-feature '' --label-offset {-offset} "
                f"(classes numbered by {label_feature})")
    for s in ordered:
        if offsets[s] != offset:
            raise ConversionFailed(
                f"{label_of[s][1]}: {label_feature} {label_of[s][0]} for synset {s}, whose index among the "
                f"{'synsets of --synsets-file' if cfg.synsets_file else 'sorted synsets'} is {index[s]}; "
                f"{label_of[ordered[0]][1]} has the offset {offset}: the file's labels are not that order shifted "
                f"by one constant")
    if offset is not None and offset > 1 and cfg.label_offset is None and cfg.synsets_file is None:
        raise ConversionFailed(
            f"classes missing: the first sorted synset, {ordered[0]}, has {label_feature} {offset}, so no record "
            f"has a label below it{damaged(found, set(range(offset)), set(present))}; numbering the synsets "
            f"present from 0 would move every label: give --synsets-file FILE (every synset, one a line: an "
            f"absent class keeps its index), or --label-offset {-offset} to number them from 0 anyway")
    lost = lost_before(found, ordered[0], set(present)) if offset == 1 and cfg.synsets_file is None else None
    if lost is not None:  # offset 1 is also ImageNet's 1-based labels: only a damaged record tells the two apart
        warnings.append(f"{lost}, damaged, carries a class before {ordered[0]} (the first synset with a record, "
                        f"{label_feature} 1): if the labels are 0-based, that class was lost to damage and every "
                        f"class index here is one below the file's label; then give --synsets-file FILE (every "
                        f"synset, one a line) or --synset-feature '' --label-offset 0")
    if cfg.label_offset is not None and offset is not None and -offset != cfg.label_offset:
        raise ConversionFailed(f"--label-offset {cfg.label_offset}, but the labels are the sorted synsets' indices "
                               f"{offset:+d} (drop --label-offset: with synsets the labels come from them)")
    absent = [s for s in classes if s not in set(present)]
    if absent:
        warnings.append(f"{len(absent)} of the {len(classes)} synsets of {cfg.synsets_file} have no record: "
                        f"{', '.join(absent[:10])}{', ...' if len(absent) > 10 else ''}"
                        f"{damaged(found, set(), set(present))}")
    source = str(cfg.synsets_file) if cfg.synsets_file is not None else cfg.synset_feature
    return Labelling(classes, None if offset is None else -offset, True, source, warnings)


def lost_before(found: dict, first: str, present: set[str]) -> str | None:
    """The first damaged record whose synset sorts before `first` or whose label is 0 (with no synset of a
    class present): where it is, its class and its damage; None if there is none."""
    for where, records in found.items():
        for r in records:
            if r.problem is not None and ((r.synset is not None and r.synset < first)
                                          or (r.label == 0 and r.synset not in present)):
                return f"{where} record {r.number} ({r.synset or r.label}: {r.problem})"
    return None


def damaged(found: dict, labels: set[int], synsets: set[str]) -> str:
    """The damaged records that may have carried a missing class, as a clause: those whose label is one of
    `labels` or whose synset is not one of `synsets` (a data CRC mismatch often spares the label), else how
    many damaged records there are, whose class cannot be told."""
    carried, unknown = [], 0
    for where, records in found.items():
        for r in records:
            if r.problem is None:
                continue
            if r.label in labels or (r.synset is not None and r.synset not in synsets and synsets):
                carried.append(f"{where} record {r.number} ({r.synset or r.label}: {r.problem})")
            elif r.label is None and r.synset is None:
                unknown += 1
    if carried:
        return f"; damaged records carried them: {', '.join(carried[:3])}{', ...' if len(carried) > 3 else ''}"
    return f"; {unknown} damaged records, whose class cannot be read, may have carried them" if unknown else ""
