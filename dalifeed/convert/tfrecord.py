"""TFRecord files of `tf.train.Example`s -> WebDataset shards (docs/format.md#tfrecord-input).

This module knows TFRecord files: their framing (length, masked CRC32C of the length, data, masked CRC32C of
the data), ImageNet's layout (`image/encoded`, `image/class/label`, `image/class/synset`, `image/filename`)
and which split a file belongs to; the Example protobuf is `tfrecord_example`'s, TensorFlow Datasets' folders
(file names, features.json, class names) `tfrecord_tfds`'s, classes and labels `tfrecord_labels`'s. Workers,
shards, resume, locks, the manifest and jobs are the shared core.

Reading happens twice: a listing pass, one worker task per file, that frames every record, checks both CRCs
and reads its label features (the classes must be known before the first sample is written); then the
shared encode pass, one record at a time by offset. A compressed file (gzip or zlib, told by its bytes, not
its name) is inflated once into $TMPDIR and read from there, since a record in the middle of a compressed
stream cannot be reached without inflating what comes before it; the copies are removed when the conversion
ends, but for a stop by a signal (kept for the resume, and the stop's line says where).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import google_crc32c

from ..format import (
    CLASS_I64_MEMBER,
    CLASS_MEMBER,
    IMAGE_MEMBER,
    META_MEMBER,
    ShardManifest,
    check_split_name,
    listing_digest,
)
from ..runtime import FolderInUse, Stopped
from .core import Plan, convert, stat_source
from .imagefolder import SPLIT_NAMES, SPLIT_ORDER
from .images import ImageError, to_jpeg
from .options import ShardOptions, UsageError
from .shards import ConversionFailed, Sample, Skip, SourceFile, ordered_map
from .tfrecord_example import ExampleError, Feature, parse_example
from .tfrecord_labels import Labelling, label_records
from .tfrecord_tfds import TfdsInfo, check_file_format, count_warnings, is_metadata, read_tfds, tfds_name

HEADER = struct.Struct("<QI")  # length, masked CRC32C of the length's 8 bytes
FOOTER = struct.Struct("<I")  # masked CRC32C of the data
INDEX_SUFFIXES = (".idx", ".index")  # DALI's tfrecord2idx and similar index files: not records


@dataclass(kw_only=True)
class TFRecordConfig(ShardOptions):
    """The options of `shard-convert tfrecord`: TFRecord files of `tf.train.Example`s in ImageNet's layout
    (an encoded image, an int64 class label, optionally a synset and a file name per record) and where
    their shards go. Keyword arguments only. Gzip- or zlib-compressed files are read too.

    Example:
        ```python
        from dalifeed.convert import TFRecordConfig, convert_tfrecord

        if __name__ == "__main__":  # the conversion's workers start by importing this script
            convert_tfrecord(TFRecordConfig(src="/data/imagenet-tfrecords", out="/data/shards", label_offset=-1))
        ```

    Attributes:
        src: A TFRecord file, or a folder of them.
        split: Put every file into this split; None: the split each file's name says (TensorFlow Datasets'
            `<dataset>-<split>.tfrecord-NNNNN-of-NNNNN`: the split after the dataset's name; else `train-*`:
            train, `validation-*`, `val-*`, `valid-*`: val, `test-*`: test; files of other names are listed as
            skipped). Refused when the files' names say two splits. Default None.
        label_offset: Without synsets: added to every label (-1 for ImageNet's 1-based labels, where 0 is
            background). With synsets the labels are the sorted synsets' indices and this, if given, is
            checked against them (or, with the first class absent, numbers the present classes from 0).
            Default None.
        image_feature: The bytes feature holding the encoded image. Default `"image/encoded"`; in a TensorFlow
            Datasets folder that lacks it, its `Image` feature (among several, the one `supervisedKeys` names).
        label_feature: The int64 feature holding the class index. Default `"image/class/label"`; in a TensorFlow
            Datasets folder that lacks it, its `ClassLabel` feature (likewise).
        synset_feature: The bytes feature naming the class (e.g. n01440764); where records have it, the
            classes are the sorted synsets (torchvision ImageFolder's order). `""` ignores it and numbers the
            classes by the label feature alone. Default `"image/class/synset"`.
        filename_feature: The bytes feature kept in each sample's JSON as `filename`, to trace it back.
            Default `"image/filename"`.
        synsets_file: A text file listing every synset, one a line (its first word, so ImageNet's synsets file
            or `LOC_synset_mapping.txt`): the classes in the file's order, absent ones too, so an absent class
            keeps its index; None: the synsets the records hold. Needs `synset_feature`. Default None.
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
    split: str | None = None
    label_offset: int | None = None
    image_feature: str = "image/encoded"
    label_feature: str = "image/class/label"
    synset_feature: str = "image/class/synset"
    filename_feature: str = "image/filename"
    synsets_file: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.src = Path(self.src)
        self.synsets_file = Path(self.synsets_file) if self.synsets_file is not None else None

    def validate(self) -> None:
        """Check every option up front, naming the bad value (`UsageError`)."""
        self.validate_shard_options()
        if not self.src.exists():
            raise UsageError(f"{self.src}: source does not exist")
        if self.src.is_dir() and (self.folder.resolve() == self.src.resolve()
                                  or self.src.resolve() in self.folder.resolve().parents):
            raise UsageError(f"{self.folder}: output folder must not be inside the source folder {self.src}")
        if not self.image_feature or not self.label_feature:
            raise UsageError("--image-feature and --label-feature must name a feature")
        if self.synsets_file is not None and not self.synsets_file.is_file():
            raise UsageError(f"--synsets-file {self.synsets_file}: no such file")
        if self.synsets_file is not None and not self.synset_feature:
            raise UsageError("--synsets-file lists the classes of --synset-feature: give both, or neither")
        if self.split is not None:
            try:
                check_split_name(self.split)
            except ValueError as e:
                raise UsageError(f"--split {e}") from None

    @property
    def root(self) -> Path:
        """What the files' names in the manifest are relative to: SRC, or the folder of a SRC file."""
        return self.src if self.src.is_dir() else self.src.parent

    def output_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"split": self.split, "label_offset": self.label_offset, "image_feature": self.image_feature,
                "label_feature": self.label_feature, "synset_feature": self.synset_feature,
                "filename_feature": self.filename_feature,
                **({"synsets_file": str(self.synsets_file)} if self.synsets_file is not None else {}),
                **self.shard_options()}


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's CRC: CRC32C, rotated right by 15 bits, plus a constant."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- listing: files, their split, their records ----------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """One record as the listing pass found it: where its data is (in the file read, which is the inflated
    copy of a compressed file), what its label features say, and why it cannot be converted, if so."""

    number: int  # 0-based, in its file
    offset: int  # of the data, in the file read
    length: int
    label: int | None = None
    synset: str | None = None
    filename: str = ""
    problem: str | None = None


@dataclass(frozen=True)
class Item:
    """One record to encode: the source file (relative to SRC), the file read, the record, its label."""

    relpath: str
    read_path: str
    record: Record
    label: int
    class_name: str
    problem: str | None = None


def find_files(src: Path) -> list[Path]:
    """SRC itself, or every file under it (sorted, recursively), but index files and the metadata files
    TensorFlow Datasets writes beside its records (read by `tfrecord_tfds`)."""
    if src.is_file():
        return [src]
    found = []
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        dirnames.sort()
        found += [Path(dirpath, name) for name in sorted(filenames)
                  if not name.endswith(INDEX_SUFFIXES) and not is_metadata(name)]
    if not found:
        raise UsageError(f"{src}: no files in this folder (expected TFRecord files such as train-00000-of-01024)")
    return found


# Files beside the records that are plainly not records: they are listed as skipped, never taken as a split's files
NOT_RECORDS = (".txt", ".json", ".csv", ".tsv", ".md", ".py", ".sh", ".yaml", ".yml", ".pbtxt", ".html")


def said_split(name: str) -> tuple[str, str] | None:
    """The split a file's name says, as the name spells it (lower case) and as dalifeed's split. TensorFlow
    Datasets' `<dataset>-<split>.tfrecord-00000-of-00004`: the part after the dataset's name (`validation` ->
    val; a split of another name keeps it). Else, as build_imagenet_data.py's `train-00000-of-01024`: the part
    before the first '-', '_' or '.', looked up as split folders are (SPLIT_NAMES)."""
    tfds = tfds_name(name)
    if tfds is not None:
        try:
            return tfds[0].lower(), check_split_name(SPLIT_NAMES.get(tfds[0].lower(), tfds[0]))
        except ValueError:
            return None
    stem = name.replace("_", "-").replace(".", "-").split("-", 1)[0].lower()
    return (stem, SPLIT_NAMES[stem]) if stem in SPLIT_NAMES else None


def inflated_path(path: Path, out: str, job: int) -> Path:
    """Where a compressed file's records are kept inflated: named by the file's path, size and mtime (a
    changed file is inflated again), OUT and the job (each conversion removes its own when done)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{out}\0{job}".encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir(), "dalifeed-inflated", f"{key}.tfrecord")


def compression(path: Path) -> str | None:
    """'gzip' or 'zlib' when the file is compressed, None for plain records (whose first length CRC holds)."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) == HEADER.size:
        length, crc = HEADER.unpack(head)
        if masked_crc(head[:8]) == crc:
            return None
    return compression_of(head[:2])


def compression_of(head: bytes) -> str | None:
    """'gzip' or 'zlib' when the two bytes start such a stream."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if len(head) >= 2 and (head[0] & 0x0F) == 8 and (head[0] << 8 | head[1]) % 31 == 0:
        return "zlib"
    return None


def inflate(path: Path, dest: Path) -> str | None:
    """Inflate a gzip or zlib file into `dest` (atomically; kept when already there); None, or why its
    stream ended early (the records before that point are still read). Streams one after another (gzip's
    members, as `gzip -d` reads them) are inflated in turn; bytes after them that start no stream are a problem."""
    problem_note = dest.with_suffix(".problem")
    if dest.is_file():
        return problem_note.read_text() if problem_note.is_file() else None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(path, "rb") as src, open(tmp, "wb") as out:
            problem = inflate_streams(src, out, os.path.getsize(path))
        if problem:
            problem_note.write_text(problem)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # interrupted: a full-size temporary file must not stay behind
    return problem


def inflate_streams(src, out, size: int) -> str | None:
    inflater, pending = zlib.decompressobj(wbits=47), b""  # 47: a gzip or zlib header, whichever it is
    while chunk := pending or src.read(1 << 22):
        pending = b""
        try:
            out.write(inflater.decompress(chunk))
        except zlib.error as e:
            return f"compressed stream corrupt ({e})"
        if inflater.eof:
            pending = inflater.unused_data or src.read(1 << 22)
            if not pending:
                return None
            if compression_of(pending[:2]) is None:
                left = len(pending) + size - src.tell()
                return f"{left} bytes after the compressed stream start no other stream"
            inflater = zlib.decompressobj(wbits=47)
    out.write(inflater.flush())
    return None if inflater.eof else "compressed stream truncated"


@dataclass(frozen=True)
class FileJob:
    path: str
    read_path: str  # the file itself, or where a compressed one is inflated to
    compression: str | None  # gzip | zlib | None
    features: tuple[str, str, str]  # label, synset, filename


NOT_TFRECORD = "not a TFRecord file (its first bytes frame no record and start no gzip or zlib stream)"


def list_records(job: FileJob) -> list[Record]:
    """Worker: frame every record of one file, check both CRCs and read its label features. A record that
    fails is one Record with the problem; a broken length (which hides where the next record starts) ends
    the file with one Record saying how many bytes were left unread."""
    stream_problem = job.compression and inflate(Path(job.path), Path(job.read_path))
    records: list[Record] = []
    label_key, synset_key, filename_key = job.features
    size = os.path.getsize(job.read_path)
    with open(job.read_path, "rb") as f:
        offset = 0
        while offset < size:
            number = len(records)
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                records.append(Record(number, offset, 0, problem=f"truncated: {size - offset} stray bytes at the end"))
                break
            length, crc = HEADER.unpack(head)
            if masked_crc(head[:8]) != crc and offset == 0:
                records.append(Record(0, 0, 0, problem=NOT_TFRECORD))
                break
            if masked_crc(head[:8]) != crc:
                records.append(Record(number, offset, 0, problem=f"length CRC mismatch at byte {offset}: the rest of "
                                                                 f"the file ({size - offset} bytes) cannot be framed"))
                break
            data_at = offset + HEADER.size
            if data_at + length + FOOTER.size > size:
                records.append(Record(number, data_at, 0, problem=f"truncated: {length} bytes of data announced, "
                                                                  f"{max(0, size - data_at - FOOTER.size)} there"))
                break
            data = f.read(length)
            (data_crc,) = FOOTER.unpack(f.read(FOOTER.size))
            offset = data_at + length + FOOTER.size
            labels = read_labels(number, data_at, data, label_key, synset_key, filename_key)
            if masked_crc(data) != data_crc:  # its labels, if they read, may name a class no other record has
                labels = dataclasses.replace(labels, problem="data CRC mismatch (corrupt record)")
            records.append(labels)
    if stream_problem and job.compression == "zlib" and size == 0:  # two bytes that only look like a zlib header
        return [Record(0, 0, 0, problem=NOT_TFRECORD)]
    if stream_problem:
        records.append(Record(len(records), -1, 0,
                              problem=f"{job.compression} file: {stream_problem}: the records after it are lost"))
    return records


def read_labels(number: int, offset: int, data: bytes, label_key: str, synset_key: str, filename_key: str) -> Record:
    try:
        features = parse_example(data)
    except ExampleError as e:
        return Record(number, offset, len(data), problem=f"not a tf.train.Example: {e}")
    label = features.get(label_key)
    synset = _text(data, features.get(synset_key)) if synset_key else None
    filename = _text(data, features.get(filename_key)) or ""
    value = label.values[0] if label is not None and label.kind == "int64" and len(label.values) == 1 else None
    return Record(number, offset, len(data), value, synset, filename)


def _text(data: bytes, feature: Feature | None) -> str | None:
    if feature is None or feature.kind != "bytes" or len(feature.values) != 1:
        return None
    start, end = feature.values[0]
    try:
        return data[start:end].decode()
    except UnicodeDecodeError:
        return None


def make_item(relpath: str, read_path: str, record: Record, labelling: Labelling, label_feature: str,
              cfg: TFRecordConfig) -> Item:
    if record.problem:
        return Item(relpath, read_path, record, -1, "", record.problem)
    if labelling.by_synset:
        if record.synset is None:
            return Item(relpath, read_path, record, -1, "", f"no {cfg.synset_feature} (other records have one)")
        label = labelling.index[record.synset]
        return Item(relpath, read_path, record, label, record.synset)
    if record.label is None:
        return Item(relpath, read_path, record, -1, "", f"no single int64 {label_feature}")
    label = record.label + (cfg.label_offset or 0)
    if label < 0:
        return Item(relpath, read_path, record, -1, "",
                    f"{label_feature} {record.label} + --label-offset {cfg.label_offset or 0} is negative")
    if label >= len(labelling.classes):  # only with the names of a TFDS ClassLabel: else the classes cover all
        return Item(relpath, read_path, record, -1, "", f"{label_feature} {record.label} is not one of the "
                                                        f"{len(labelling.classes)} classes of {labelling.source}")
    return Item(relpath, read_path, record, label, labelling.classes[label])


# --- the plan and the worker ---------------------------------------------------------------------------------

def encode_item(item: Item, image_feature: str, quality: int, max_side: int | None, max_pixels: int) -> Sample | Skip:
    """Worker: read one record by its offset, take its image, decode-check and (if needed) re-encode it."""
    if item.problem:
        return Skip(item.problem)
    record = item.record
    try:
        with open(item.read_path, "rb") as f:
            f.seek(record.offset)
            data = f.read(record.length)
    except OSError as e:
        raise ConversionFailed(f"{item.relpath}: vanished while being converted ({e.strerror or e})") from None
    if len(data) != record.length:
        raise ConversionFailed(f"{item.relpath}: changed while being converted (record {record.number} is cut short)")
    try:
        feature = parse_example(data).get(image_feature)
    except ExampleError as e:
        return Skip(f"not a tf.train.Example: {e}")
    if feature is None or feature.kind != "bytes" or len(feature.values) != 1:
        return Skip(f"no single bytes feature {image_feature}")
    start, end = feature.values[0]
    if start == end:
        return Skip(f"empty image feature ({image_feature} holds 0 bytes)")
    try:
        image = to_jpeg(data[start:end], quality, max_side, max_pixels)
    except ImageError as e:
        return Skip(str(e))
    meta = {"path": item.relpath, "record": record.number, "filename": record.filename, "class": item.class_name,
            "label": item.label, "reencoded": image.reencoded or ""}
    jpeg = SourceFile(item.read_path, end - start, record.offset + start) if image.reencoded is None else image.jpeg
    members = [
        (IMAGE_MEMBER, jpeg),
        (CLASS_MEMBER, str(item.label).encode()),
        (CLASS_I64_MEMBER, struct.pack("<q", item.label)),
        (META_MEMBER, json.dumps(meta, sort_keys=True).encode()),
    ]
    return Sample(members, image.reencoded, classes=(item.label,))


def describe_item(item: Item) -> str:
    return f"{item.relpath} record {item.record.number}"


@dataclass
class Listing:
    files: dict[str, list[Path]]  # split -> its files
    skipped: list[dict]  # files that are not a split's


def list_files(cfg: TFRecordConfig) -> Listing:
    files: dict[str, list[Path]] = {}
    skipped, named = [], {}  # named: the split a file's name says, as it spells it -> (dalifeed's split, a file)
    root = cfg.root
    check_file_format(cfg.src)
    for path in find_files(cfg.src):
        source = stat_source(path)
        said = said_split(path.name)
        if said is not None and not path.name.lower().endswith(NOT_RECORDS):  # val_labels.txt names no split's records
            named.setdefault(said[0], (said[1], path.relative_to(root).as_posix()))
        split = cfg.split or (said[1] if said is not None else None)
        problem = source.problem or ("empty file (0 bytes)" if source.size == 0 else None)
        if problem or split is None:
            reason = problem or ("not named like a split's file (train-*, validation-*, test-*, or TensorFlow "
                                 "Datasets' <dataset>-<split>.tfrecord-*): give --split to convert it")
            skipped.append({"path": path.relative_to(root).as_posix(), "reason": reason})
            continue
        files.setdefault(split, []).append(path)
    if cfg.split is not None and len(named) > 1:
        said = ", ".join(f"{path} is {name}" for name, (_, path) in sorted(named.items()))
        raise UsageError(f"--split {cfg.split} would merge the files of {len(named)} splits ({said}): leave --split "
                         f"out to convert each into its own, or give SRC one split's file")
    check_one_name_a_split(named)
    if not files:
        raise UsageError(f"{cfg.src}: no file named like a split's TFRecord file (train-*, validation-*, test-*); "
                         f"give --split NAME to convert them all into one split")
    order = {name: i for i, name in enumerate(SPLIT_ORDER)}
    return Listing(dict(sorted(files.items(), key=lambda kv: (order.get(kv[0], 9), kv[0]))), skipped)


def check_one_name_a_split(named: dict[str, tuple[str, str]]) -> None:
    """Refuse (`UsageError`) files whose names say two splits that are one split here (TFDS's `validation`
    and `dev`, `test` and `testing`): their records would be merged without a word."""
    by_split: dict[str, list[str]] = {}
    for name, (split, _) in sorted(named.items()):
        by_split.setdefault(split, []).append(name)
    for split, names in by_split.items():
        if len(names) > 1:
            said = " and ".join(f"{named[name][1]} is split {name}" for name in names[:2])
            raise UsageError(f"{said}, both {split} here: their records would be merged; keep one of the two splits' "
                             f"files in SRC, or convert each into its own OUT from a folder holding its files alone "
                             f"(with TensorFlow Datasets' metadata files copied beside them)")


def tfds_of(cfg: TFRecordConfig, listing: Listing) -> TfdsInfo | None:
    """The TensorFlow Datasets metadata beside the files converted (one dataset's: a folder of several
    datasets, or versions, is refused)."""
    folders = sorted({path.parent for paths in listing.files.values() for path in paths})
    found = [info for info in map(read_tfds, folders) if info is not None]
    if len(found) > 1:
        raise UsageError(f"{cfg.src}: TensorFlow Datasets metadata in {len(found)} folders ({found[0].folder}, "
                         f"{found[1].folder}): give one dataset's folder (<data_dir>/<name>/<version>) as SRC")
    return found[0] if found else None


def features_of(cfg: TFRecordConfig, tfds: TfdsInfo | None) -> tuple[str, str]:
    """The image and label features: as given, or, left at their defaults where features.json has no such
    feature, TFDS's Image and ClassLabel feature (`image`, `label`; `TfdsInfo.the_feature`). A feature
    given that features.json does not have is refused, as every record would be skipped for lacking it."""
    chosen = []
    for option, kind, flag in (("image_feature", "Image", "--image-feature"),
                               ("label_feature", "ClassLabel", "--label-feature")):
        name = getattr(cfg, option)
        if tfds is not None and tfds.kinds and name not in tfds.kinds:
            if name != TFRecordConfig.__dataclass_fields__[option].default:
                raise UsageError(f"{flag} {name}: {tfds.folder / 'features.json'} has no such feature (its "
                                 f"features: {', '.join(tfds.kinds)})")
            name = tfds.the_feature(kind, flag)
        chosen.append(name)
    return chosen[0], chosen[1]


def build_plan(cfg: TFRecordConfig, inflated: list[Path]) -> Plan:
    """The conversion's plan; `inflated` gets each inflated copy's path before the copy is made."""
    cfg.validate()
    listing = list_files(cfg)
    tfds = tfds_of(cfg, listing)
    image_feature, label_feature = features_of(cfg, tfds)
    root = cfg.root
    jobs, relpaths, fingerprint, source_bytes = [], [], hashlib.sha256(), 0
    for split, paths in listing.files.items():
        for path in paths:
            st = path.stat()
            relpath = path.relative_to(root).as_posix()
            fingerprint.update(f"{split}\0{relpath}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            source_bytes += st.st_size
            read_path, kind = path, compression(path)
            if kind is not None:  # inflated by the listing worker, in parallel with the other files
                read_path = inflated_path(path, cfg.location, cfg.job_index)
                inflated.append(read_path)
            jobs.append(FileJob(str(path), str(read_path), kind, (label_feature, cfg.synset_feature,
                                                                  cfg.filename_feature)))
            relpaths.append((split, relpath))
    records_of = ordered_map(list_records, jobs, cfg.workers, chunk=1)
    found = {relpath: records for (_, relpath), records in zip(relpaths, records_of)}
    names = tfds.class_names(label_feature) if tfds is not None and tfds.kinds.get(label_feature) == "ClassLabel" \
        else None
    labelling = label_records(found, cfg, label_feature, names)
    warnings = list(labelling.warnings)
    if tfds is not None:
        counted = {relpath: (*tfds_name(Path(relpath).name), sum(r.offset >= 0 for r in found[relpath]))
                   for _, relpath in relpaths if tfds_name(Path(relpath).name)}
        warnings += count_warnings(tfds, counted)
    splits: dict[str, list[Item]] = {split: [] for split in listing.files}
    entries: dict[str, list] = {split: [] for split in listing.files}
    for (split, relpath), job in zip(relpaths, jobs):
        for record in found[relpath]:
            splits[split].append(make_item(relpath, job.read_path, record, labelling, label_feature, cfg))
            entries[split].append((f"{relpath}#{record.number}", record.length))
    for name, items in splits.items():
        random.Random(f"{cfg.seed}:{name}").shuffle(items)
    source = str(cfg.src.resolve())
    extra = {"tfrecord": {"files": {split: [p.relative_to(root).as_posix() for p in paths]
                                    for split, paths in listing.files.items()},
                          "classes_from": labelling.source, "label_offset": labelling.label_offset,
                          "image_feature": image_feature, "label_feature": label_feature}}
    if tfds is not None:
        extra["tfrecord"]["tfds_metadata"] = tfds.files
    return Plan(
        kind="tfrecord", source=source, splits=splits, classes=labelling.classes,
        encode=functools.partial(encode_item, image_feature=image_feature, quality=cfg.jpeg_quality,
                                 max_side=cfg.max_side, max_pixels=cfg.max_pixels),
        describe=describe_item,
        fingerprint={"kind": "tfrecord", "source": source, "options": cfg.output_options(),
                     "listing_sha256": fingerprint.hexdigest(),
                     **({"features": [image_feature, label_feature], "classes": labelling.classes} if tfds else {})},
        listings={split: listing_digest(e) for split, e in entries.items()},
        skipped=listing.skipped, found=sum(len(v) for v in splits.values()) + len(listing.skipped),
        warnings=warnings, source_bytes=source_bytes, extra=extra,
    )


def convert_tfrecord(cfg: TFRecordConfig) -> ShardManifest:
    """Convert a TFRecord file or folder to shards in `cfg.out`, as `shard-convert tfrecord` does.

    Every record's framing and both CRCs are checked while listing; the classes are known before the first
    sample is written. A compressed file is inflated once into `$TMPDIR` and read from there; the copies are
    removed when the conversion ends (kept for a resume when it is stopped). An interrupted conversion of the
    same input and options continues where it stopped. Call it under `if __name__ == "__main__":` in a
    script: the workers start by importing it.

    Args:
        cfg: The source, the output folder and the conversion's options.

    Returns:
        The written folder's manifest (kind `"tfrecord"`), with `summary` (a `ConvertSummary`) attached.

    Raises:
        UsageError: An option is out of range, `src` is missing or holds no TFRecord file named like a split,
            or files whose names say two splits would be merged (by `split`, or as two names of one split:
            TFDS's `validation` and `dev`).
        ConversionFailed: Labels that disagree with the synsets or `label_offset`, a class no record has, or
            with `on_error="fail"` the first corrupt record (bad framing or CRC) or image that cannot be read;
            with `"skip"` those are listed in the manifest's `skipped`.
        FolderInUse: Another conversion holds `out`'s lock.
        DiskFull: The disk filled up; the message says how much more is needed.

    Example:
        ```python
        from dalifeed.convert import TFRecordConfig, convert_tfrecord

        if __name__ == "__main__":
            manifest = convert_tfrecord(TFRecordConfig(src="/data/tfrecords", out="/data/shards", label_offset=-1))
            print(manifest.classes[:3])
        ```
    """
    inflated: list[Path] = []
    try:
        manifest = convert(build_plan(cfg, inflated), cfg, "shard-convert tfrecord")
    except FolderInUse:  # the copies are the same command's, which holds OUT's lock and is reading them
        raise
    except Stopped as e:
        remove_partial(inflated)  # a killed worker's: a resume starts that copy anew
        kept = [p for p in inflated if p.is_file()]
        if not kept:
            remove_inflated(inflated)  # their folder, left empty
        else:
            size = sum(p.stat().st_size for p in kept)
            e.add_note(f"the inflated copies of its {len(kept)} compressed files are kept for the resume: "
                       f"{size / 2**20:.1f} MiB in {kept[0].parent} (removed when the conversion finishes)")
        raise
    except BaseException:
        remove_inflated(inflated)
        raise
    remove_inflated(inflated)
    return manifest


def remove_inflated(inflated: list[Path]) -> None:
    """Remove the inflated copies (with their .problem notes and the temporary file of a copy a killed
    worker left half-written), and their folder once empty."""
    remove_partial(inflated)
    for path in inflated:
        path.unlink(missing_ok=True)
        path.with_suffix(".problem").unlink(missing_ok=True)
    if inflated and inflated[0].parent.is_dir() and not any(inflated[0].parent.iterdir()):
        shutil.rmtree(inflated[0].parent, ignore_errors=True)


def remove_partial(inflated: list[Path]) -> None:
    """Remove the temporary files of copies that workers killed mid-inflation left half-written."""
    for path in inflated:
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):
            tmp.unlink(missing_ok=True)
