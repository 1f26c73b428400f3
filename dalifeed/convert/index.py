"""`shard-convert index`: adopt WebDataset tars that dalifeed did not write, in place, without changing a byte
of them (docs/format.md, "Shards from elsewhere").

Every tar is read once. Its samples are grouped as webdataset and DALI's `wds2idx` group them (consecutive
members sharing the name up to the first dot after the last slash: `format.split_member_name`); each sample
is kept or left out with a reason (no image, no label, an image not every decoder reads alike, with
`--decode` an image that does not decode, a duplicate key, a key split across two tars); the DALI index
written beside the tar (or into `--index-dir`) lists the kept samples only, which is how the left-out ones
stay out of training without touching the tar. Compressed tars, which DALI cannot read, are named with the
command that decompresses them. The manifest (kind `webdataset`) is written last.

Labels without a binary member: a `.cls` member is listed in the index as it is and the graph parses its ASCII
digits (`dalifeed.pipelines.textlabels`); any other label becomes an empty index component `dalifeed.label`
whose name ends in the class index, which the graph reads from DALI's `source_info`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from .. import s3
from ..atomic import temp_name, write_atomic
from ..format import (
    MANIFEST_NAME,
    IndexEntry,
    ShardInfo,
    ShardManifest,
    SplitInfo,
    check_split_name,
    index_text,
    split_member_name,
)
from ..runtime import usable_cores
from .images import DEFAULT_MAX_PIXELS, ImageError, JpegFrame, decode_check, read_jpeg_frame, sniff_format
from .shards import ordered_map
from .tarscan import TarDamaged, TarScan

KIND = "webdataset"
IMAGE_EXTS = ("jpg", "jpeg")  # the first of these a sample has is its image; DALI reads it as `jpg`
# Extensions of image files: never the label member, and the last extension that makes `name.more.EXT` an
# image whose dotted name split it from its key (`dotted_key_problem`)
IMAGE_FILE_EXTS = {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"}
NAME_LABEL_EXT = "dalifeed.label"  # the empty index component whose name carries the label (module docstring)
LABEL_DIGITS = 10  # width of the decimal label in that name, and the longest `.cls` text the graph parses
CLS_DIGITS = re.compile(rf"[0-9]{{1,{LABEL_DIGITS}}}")  # a `.cls` label DALI's graph reads, whitespace cut off
# `train-000000.tar`, `val_00012.tar`: split prefix, separator, shard number. `00000.tar` (img2dataset) has none.
SHARD_NAME = re.compile(r"^(?P<split>.*?)[-_]?(?P<number>\d+)\.tar$")
SPLIT_NAMES = {"train": "train", "training": "train",
               "val": "val", "valid": "val", "validation": "val", "dev": "val", "eval": "val", "evaluation": "val",
               "test": "test", "testing": "test"}
DEFAULT_SPLIT = "train"  # of tars whose names carry no split prefix
# Compressed tars, which DALI's webdataset reader cannot read (it seeks to each member's offset in the tar
# itself), and the program that gives back the plain `.tar` beside each (`decompress_command`).
COMPRESSED_TARS = {".tar.gz": "gzip", ".tgz": "gzip", ".tar.xz": "xz", ".txz": "xz", ".tar.zst": "zstd",
                   ".tzst": "zstd", ".tar.bz2": "bzip2", ".tbz2": "bzip2"}
# Each writes NAME.tar beside NAME.tar.gz (NAME.tgz ...) and keeps the compressed file.
DECOMPRESS_IN_PLACE = {"gzip": "gunzip -k {src}", "xz": "xz -dk {src}", "bzip2": "bunzip2 -k {src}",
                       "zstd": "zstd -d {src} -o {tar}"}


class IndexUsageError(Exception):
    """A usage error of `shard-convert index` (exit 2): a bad folder, option or classes file."""


class IndexDataError(Exception):
    """The tars cannot be indexed (exit 1): unreadable, or not one usable sample."""


@dataclass
class IndexConfig:
    src: Path | str  # a local folder, or s3://bucket/prefix
    split: str | None = None  # every tar is of this split; default: from each file name's prefix
    label_member: str = "cls"  # the member the label is read from: cls (ASCII int), json (with label_key), txt
    label_key: str | None = None  # with label_member json: the key holding the label (an int, or a class name)
    classes_file: Path | None = None  # one class name a line; line i is class i
    max_pixels: int = DEFAULT_MAX_PIXELS
    decode: bool = False  # decode every image (PIL, in worker processes) and leave out what does not decode
    workers: int = field(default_factory=usable_cores)  # tars read at once (with decode: decoders); same output
    index_dir: Path | None = None  # where the indexes and manifest go; default: beside the tars, in `src`

    def __post_init__(self) -> None:
        self.src = s3.normalize(str(self.src)) if s3.is_s3_url(self.src) else Path(self.src)
        if isinstance(self.src, Path) and not self.src.is_dir():
            raise IndexUsageError(f"{self.src}: no such folder")
        if self.label_member == "json" and not self.label_key:
            raise IndexUsageError("--label-member json needs --label-key (the key of the .json holding the label)")
        if self.label_member != "json" and self.label_key:
            raise IndexUsageError(f"--label-key applies to --label-member json, not {self.label_member}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.label_member):
            raise IndexUsageError(f"--label-member {self.label_member!r}: not a member extension")
        if self.label_member.lower() in IMAGE_FILE_EXTS:
            raise IndexUsageError(f"--label-member {self.label_member}: an image's extension; the label member is "
                                  f"the one holding the class: cls (an integer), json (with --label-key) or txt "
                                  f"(a class name)")
        if self.split is not None:
            try:
                check_split_name(self.split)
            except ValueError as e:
                raise IndexUsageError(f"--split {e}") from None
        if self.classes_file is not None and not Path(self.classes_file).is_file():
            raise IndexUsageError(f"--classes-file {self.classes_file}: no such file")
        if self.workers < 1:
            raise IndexUsageError(f"--workers must be >= 1, got {self.workers}")
        if self.index_dir is not None:
            if isinstance(self.src, str) or s3.is_s3_url(self.index_dir):
                raise IndexUsageError("--index-dir works with a local SRC and a local folder only (tars in a store "
                                      "get their indexes beside them, in the store)")
            self.index_dir = Path(self.index_dir)
            if self.index_dir.exists() and not self.index_dir.is_dir():
                raise IndexUsageError(f"--index-dir {self.index_dir}: not a folder")
            if self.index_dir.resolve() == self.src.resolve():
                self.index_dir = None  # beside the tars: the default

    @property
    def label_from_member(self) -> bool:
        """Whether DALI reads the label's ASCII digits from the `.cls` member itself (else from the index)."""
        return self.label_member == "cls"

    def to_json(self) -> dict:
        """The options the index depends on (the manifest's `options`): not the worker count."""
        doc = {k: v for k, v in asdict(self).items() if k != "workers"}
        return {**doc, "src": str(self.src), "classes_file": str(self.classes_file) if self.classes_file else None,
                "index_dir": str(self.index_dir) if self.index_dir else None}


# ----------------------------------------------------------------------------------------------------
# Reading a tar: members -> samples, as wds2idx groups them


@dataclass
class Member:
    ext: str
    offset: int  # of the data, in the tar
    size: int
    name: str


@dataclass(frozen=True)
class ImageHead:
    """What an image member's first bytes say: its JPEG frame header (`images.read_jpeg_frame`, which walks
    the marker segments up to the first scan and reads nothing of the compressed data), or else the format
    its magic number claims."""

    frame: JpegFrame | None
    format: str | None  # when frame is None: `images.sniff_format` (None: no image format)

    @classmethod
    def read(cls, data: bytes | memoryview) -> ImageHead:
        frame = read_jpeg_frame(data)
        return cls(frame, None if frame is not None else sniff_format(bytes(data[:SNIFF_BYTES])))


SNIFF_BYTES = 16  # the longest magic number `sniff_format` compares is 12 bytes


@dataclass
class Sample:
    key: str
    members: list[Member] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)  # the label members' bytes (and images' with --decode)
    heads: dict[str, ImageHead] = field(default_factory=dict)  # image extension -> its first member's head
    reason: str | None = None  # why it is left out, or None
    label: int | str | None = None  # an int (class index) or a class name, before classes are known
    label_size: int | None = None  # `.cls` labels: the digits' length (whitespace after them cut off)


class TarFolder:
    """Where the tars are, a local folder or s3://bucket/prefix: what `index` lists, reads and writes there."""

    def __init__(self, location: Path | str):
        self.location = location
        self.remote = isinstance(location, str)

    def where(self, name: str) -> str:
        return s3.join(self.location, name) if self.remote else str(self.location / name)

    def file_names(self) -> list[str]:
        """The files directly in the folder but hidden ones, in name order (zero-padded numbers sort alike)."""
        if self.remote:
            names = [n for n in s3.list_objects(self.location) if "/" not in n]
        else:
            names = [p.name for p in self.location.iterdir() if p.is_file()]
        return sorted(n for n in names if not n.startswith("."))

    def open(self, name: str):
        return s3.ObjectStream(self.where(name)) if self.remote else open(self.location / name, "rb")

    def read_text(self, name: str) -> str | None:
        """A small file of the folder (an index, the manifest), or None if it is not there."""
        try:
            return (s3.get_bytes(self.where(name)) if self.remote else (self.location / name).read_bytes()).decode()
        except (s3.ObjectProblem, FileNotFoundError):
            return None

    def check_writable(self, fix: str) -> None:
        """IndexUsageError, before any tar is read, when a local folder takes no new file (read-only); `fix`
        says what to do instead."""
        if self.remote:
            return  # a store's permissions show at the first PUT
        try:
            self.location.mkdir(parents=True, exist_ok=True)
            probe = temp_name(self.location / MANIFEST_NAME)  # what the atomic writes create first
            probe.open("wb").close()
            probe.unlink()
        except OSError as e:
            raise IndexUsageError(f"{self.location}: cannot write the indexes and the manifest there "
                                  f"({e.strerror or e}): {fix}") from None

    def write(self, name: str, data: bytes) -> None:
        """Written whole (atomically on disk; an object PUT is whole by itself)."""
        if self.remote:
            s3.put_bytes(self.where(name), data)
        else:
            write_atomic(self.location / name, data)


@dataclass
class ScannedTar:
    name: str
    samples: list[Sample]
    bytes: int
    sha256: str


def read_tar_samples(folder: TarFolder, name: str, wanted: set[str], cfg: IndexConfig,
                     keep_images: bool = False) -> ScannedTar:
    """The samples of tar `name` in order, each judged (`judge`) as soon as its last member is read, and the
    tar's size and sha256, from one sequential read (`tarscan`). Of an image member only its headers are
    parsed (`ImageHead`), from the read buffer; the bytes of the other `wanted` members (the label's) are
    kept until the sample is judged.
    With `keep_images` (index and verify --decode) the images' bytes are kept too: one tar's, never more.
    IndexDataError naming the tar if it cannot be read to its end."""
    samples: list[Sample] = []

    def finish(sample: Sample) -> None:
        judge(sample, cfg)
        sample.heads = {}
        if not keep_images:
            sample.data = {}

    try:
        with folder.open(name) as stream:
            scan = TarScan(stream)
            for member in scan.members():
                named = split_member_name(member.name)
                if named is None:  # a hidden file, or no extension: a member of no sample
                    continue
                key, ext = named
                if not samples or samples[-1].key != key:
                    if samples:
                        finish(samples[-1])
                    samples.append(Sample(key))
                sample = samples[-1]
                sample.members.append(Member(ext, member.offset, member.size, member.name))
                if ext in IMAGE_EXTS:
                    if ext not in sample.heads:
                        data = scan.data()
                        sample.heads[ext] = ImageHead.read(data)
                        if keep_images:
                            sample.data[ext] = bytes(data)
                elif ext in wanted and ext not in sample.data:
                    sample.data[ext] = bytes(scan.data())
            if samples:
                finish(samples[-1])
    except (TarDamaged, OSError) as e:
        raise IndexDataError(f"{folder.where(name)}: unreadable tar ({e})") from None
    return ScannedTar(name, samples, scan.size, scan.sha256.hexdigest())


# ----------------------------------------------------------------------------------------------------
# Judging a sample: image, label


def image_member(sample: Sample) -> Member | None:
    return next((m for m in sample.members if m.ext in IMAGE_EXTS), None)


def image_problem(sample: Sample, max_pixels: int) -> str | None:
    """Why the sample's image is left out (the conversion's header rule, docs/format.md), or None."""
    member = image_member(sample)
    if member is None:
        return dotted_key_problem(sample) or \
            f"no image: no .jpg or .jpeg member (has {', '.join(sorted({'.' + m.ext for m in sample.members}))})"
    head = sample.heads[member.ext]
    frame = head.frame
    if frame is None:
        what = head.format
        return f"image not a JPEG: .{member.ext} is {what or 'no image format'} (shard-convert imagefolder " \
               f"re-encodes these; index keeps the tars as they are)"
    reason = frame.reencode_reason()
    if reason is not None:
        return f"image {reason}: .{member.ext} is a {frame.describe()}, which not every decoder reads alike"
    if frame.width * frame.height > max_pixels:
        return f"image larger than --max-pixels {max_pixels} ({frame.width}x{frame.height})"
    if sum(m.ext == member.ext for m in sample.members) > 1:
        return f"image twice: two .{member.ext} members"
    return None


def dotted_key_problem(sample: Sample) -> str | None:
    """Image files whose names have dots before their extension (`img.0.v2.jpg`): webdataset and DALI cut a
    member's name at the first dot of its file name, so their key is `img` and their extension `0.v2.jpg`,
    and all such images in a row became one sample without a `.jpg`. Says so, with an example and the fix;
    None if the sample has no such member."""
    dotted = [m for m in sample.members if "." in m.ext and m.ext.rsplit(".", 1)[1].lower() in IMAGE_FILE_EXTS]
    if not dotted:
        return None
    example = dotted[0].name
    folder, _, base = example.rpartition("/")
    stem, _, last = base.rpartition(".")
    renamed = (folder + "/" if folder else "") + stem.replace(".", "_") + "." + last
    return (f"dotted key: {len(dotted)} image(s) such as {example!r} have key {sample.key!r} and extension "
            f"{dotted[0].ext!r}: webdataset and DALI take the text before the first dot of a file name as its "
            f"sample's key, so they became one sample; rename the files so the key has no dots, e.g. {renamed!r}")


def read_label(sample: Sample, cfg: IndexConfig) -> tuple[int | str | None, str | None]:
    """(the label as stored: an int or a class name, None) or (None, why it cannot be read)."""
    ext = cfg.label_member
    if ext not in sample.data:
        return None, f"no label: no .{ext} member"
    try:
        text = sample.data[ext].decode("utf-8")
    except UnicodeDecodeError:
        return None, f"label unreadable: .{ext} is not UTF-8 text"
    if ext == "json":
        try:
            doc = json.loads(text)
        except ValueError as e:
            return None, f"label unreadable: .json is not JSON ({e})"
        if not isinstance(doc, dict) or cfg.label_key not in doc:
            return None, f"no label: .json has no key {cfg.label_key!r}"
        value = doc[cfg.label_key]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return None, f"label unreadable: .json {cfg.label_key!r} is {type(value).__name__} {value!r:.40}"
        if isinstance(value, int) and value < 0:
            return None, f"label unreadable: .json {cfg.label_key!r} is {value}, negative"
        return (value.strip() if isinstance(value, str) else value), None
    if ext == "cls":
        digits = text.rstrip()
        if not CLS_DIGITS.fullmatch(digits):
            named = (": a class name? .cls holds a class index; names go in a member such as .txt, indexed with "
                     "--label-member txt") if any(c.isalpha() for c in digits) else ""
            return None, (f"label unreadable: .cls is {text[:40]!r}, not a decimal integer (webdataset's "
                          f"convention){named}")
        sample.label_size = len(digits.encode())
        return int(digits), None
    name = text.strip()
    return (name, None) if name else (None, f"no label: .{ext} is empty")


WHITESPACE = re.compile(r"\s")  # in a str pattern, what str.isspace calls whitespace


def judge(sample: Sample, cfg: IndexConfig) -> None:
    """Set the sample's label, or its reason to be left out."""
    spaced = next((m.name for m in sample.members if WHITESPACE.search(m.name)), None)
    if spaced is not None:  # DALI's index separates its fields by spaces
        sample.reason = f"name with whitespace: {spaced[:60]!r} cannot be written in a DALI index"
        return
    reason = image_problem(sample, cfg.max_pixels)
    if reason is None:
        label, reason = read_label(sample, cfg)
        sample.label = label
    sample.reason = reason


# ----------------------------------------------------------------------------------------------------
# Splits, tars, keys across tars


def split_of(name: str, forced: str | None) -> str:
    if forced:
        return forced
    match = SHARD_NAME.match(name)
    prefix = match.group("split") if match else name.rsplit(".", 1)[0]
    if not prefix:
        return DEFAULT_SPLIT
    last = re.split(r"[-_.]", prefix)[-1].lower()  # imagenet-val-000000.tar, laion_train_00001.tar
    return SPLIT_NAMES.get(prefix.lower()) or SPLIT_NAMES.get(last) or prefix


def find_tars(names: list[str], forced_split: str | None) -> dict[str, list[str]]:
    """The tars among the folder's file `names` by split, each in name order."""
    splits: dict[str, list[str]] = {}
    for name in names:
        if name.endswith(".tar"):
            splits.setdefault(split_of(name, forced_split), []).append(name)
    return splits


def compressed_suffix(name: str) -> str | None:
    return next((suffix for suffix in COMPRESSED_TARS if name.endswith(suffix)), None)


def decompress_command(folder: TarFolder, name: str) -> str:
    """The command that writes the plain tar beside compressed tar `name`, keeping the compressed one."""
    suffix = compressed_suffix(name)
    tool, tar = COMPRESSED_TARS[suffix], name[:-len(suffix)] + ".tar"
    if folder.remote:
        return f"aws s3 cp {folder.where(name)} - | {tool} -dc | aws s3 cp - {folder.where(tar)}"
    return DECOMPRESS_IN_PLACE[tool].format(src=shlex.quote(folder.where(name)), tar=shlex.quote(folder.where(tar)))


@dataclass
class CompressedTars:
    """The compressed tars of a folder: `left_out`, without their plain tar beside them, are data DALI cannot
    read (each a skipped entry naming the command that decompresses it); `copies` have it (noted only)."""

    left_out: list[str]
    copies: list[str]

    @classmethod
    def find(cls, names: list[str]) -> CompressedTars:
        present = set(names)
        compressed = [n for n in names if compressed_suffix(n)]
        copies = [n for n in compressed if n[:-len(compressed_suffix(n))] + ".tar" in present]
        return cls([n for n in compressed if n not in copies], copies)

    def commands(self, folder: TarFolder) -> dict[str, str]:
        """Each compressed tar left out -> the command that decompresses it."""
        return {name: decompress_command(folder, name) for name in self.left_out}

    def skipped(self, folder: TarFolder) -> list[dict]:
        return [{"path": name, "reason": f"compressed tar: DALI reads only uncompressed tars; decompress it "
                                         f"({command}) and index again"}
                for name, command in self.commands(folder).items()]

    def notes(self) -> list[str]:
        return [f"{name}: not read; taken as the compressed copy of {name[:-len(compressed_suffix(name))]}.tar "
                f"beside it, which is indexed" for name in self.copies]


def mark_keys_across_tars(tars: list[ScannedTar]) -> None:
    """Leave out every sample whose key also appears elsewhere in the split: a key at the end of one tar and
    the start of the next is a sample split across them; any other repeat is a duplicate key. All its
    occurrences are left out: which one is right cannot be told."""
    where: dict[str, list[tuple[int, int]]] = {}
    for t, tar in enumerate(tars):
        for i, sample in enumerate(tar.samples):
            where.setdefault(sample.key, []).append((t, i))
    for key, places in where.items():
        if len(places) < 2:
            continue
        names = [tars[t].name for t, _ in places]
        (t0, i0), (t1, i1) = places[0], places[-1]
        split_across = len(places) == 2 and t1 == t0 + 1 and i1 == 0 and i0 == len(tars[t0].samples) - 1
        samples = [tars[t].samples[i] for t, i in places]
        for t, i in places:
            if split_across:
                reason = f"key split across tars: its members are in {names[0]} and {names[1]}"
            elif members_apart(samples) and len(set(names)) == 1:
                reason = (f"members not adjacent: {key}'s files "
                          f"({', '.join(m.name for s in samples for m in s.members)}"
                          f") are apart in {names[0]}, which webdataset reads as {len(places)} samples: the tar was "
                          f"written in directory order (a plain `tar cf DIR`); write it again with the files of each "
                          f"key together: tar --sort=name -cf TAR -C DIR .")
            else:
                reason = f"duplicate key: {len(places)} samples named {key} (in {', '.join(sorted(set(names)))})"
            tars[t].samples[i].reason = reason


def members_apart(samples: list[Sample]) -> bool:
    """Whether the samples of one key hold different members (a .jpg here, its .cls there): one sample's files
    apart in the tar, not the same sample twice."""
    seen: set[str] = set()
    for sample in samples:
        exts = {m.ext for m in sample.members}
        if exts & seen:
            return False
        seen |= exts
    return True


# ----------------------------------------------------------------------------------------------------
# Classes


def read_classes_file(path: Path) -> list[str]:
    names = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    names = [n for n in names if n]
    if not names:
        raise IndexUsageError(f"--classes-file {path}: no class names in it")
    dupes = sorted(n for n, c in Counter(names).items() if c > 1)
    if dupes:
        raise IndexUsageError(f"--classes-file {path}: class {dupes[0]!r} appears twice")
    return names


def decide_classes(labels: list[int | str], classes_file: Path | None) -> list[str]:
    """Class i's name: line i of the classes file; else, for integer labels, the integers 0..max; else the
    class names seen, sorted as ImageFolder sorts its folders."""
    ints = [v for v in labels if isinstance(v, int)]
    if classes_file is not None:
        names = read_classes_file(classes_file)
        beyond = sum(v >= len(names) for v in ints)
        if beyond:  # the file is short, not the data wrong: most likely a file for another dataset or version
            raise IndexUsageError(f"--classes-file {classes_file} names {len(names)} classes (0..{len(names) - 1}) "
                                  f"but the labels go up to {max(ints)}: {beyond} of {len(labels)} samples would be "
                                  f"left out; give a file with a line for each class")
        return names
    names = sorted({v for v in labels if isinstance(v, str)})
    if ints and names:
        raise IndexDataError(f"labels are both integers ({ints[0]}) and class names ({names[0]!r}): give "
                             f"--classes-file to name the integers' classes")
    return [str(i) for i in range(max(ints) + 1)] if ints else names


def class_index(label: int | str, classes: list[str], lookup: dict[str, int]) -> tuple[int | None, str | None]:
    if isinstance(label, int):
        if label >= len(classes):
            return None, f"label out of range: {label}, the classes are 0..{len(classes) - 1}"
        return label, None
    if label not in lookup:
        return None, f"label not a class: {label[:60]!r} is not in the classes file"
    return lookup[label], None


# ----------------------------------------------------------------------------------------------------
# The index lines


def index_entries(sample: Sample, cfg: IndexConfig) -> list[IndexEntry]:
    """The kept sample's DALI index entries: wds2idx's, with the image member's extension read as `jpg`, a
    `.cls` cut to its digits, or one more empty component whose name ends in the class index."""
    image = image_member(sample)
    entries = []
    for m in sample.members:
        ext, size = m.ext, m.size
        if m is image:
            ext = "jpg"
        elif m.ext == "jpg":
            continue  # not the image (a .jpeg is): DALI would see two `jpg` components
        if cfg.label_from_member and m.ext == "cls" and sample.label_size is not None:
            size = sample.label_size
        entries.append((ext, m.offset, size, m.name))
    if not cfg.label_from_member:
        entries.append((NAME_LABEL_EXT, image.offset, 0, f"{sample.key}.label-{sample.label:0{LABEL_DIGITS}d}"))
    return entries


def kept_index_text(samples: list[Sample], cfg: IndexConfig) -> str:
    """The index of a tar's kept samples (`format.index_text`, the one writer of index files)."""
    return index_text([index_entries(s, cfg) for s in samples if s.reason is None])


# ----------------------------------------------------------------------------------------------------
# The whole folder


@dataclass
class IndexSummary:
    samples: int
    found: int  # samples seen (the manifest's `found` also counts the compressed tars left out)
    shards: int
    splits: dict[str, int]
    compressed: dict[str, str] = field(default_factory=dict)  # compressed tar left out -> its decompress command

    def describe(self, manifest: ShardManifest) -> str:
        samples = [e for e in manifest.skipped if e["path"] not in self.compressed]
        splits = ", ".join(f"{name} {n}" for name, n in self.splits.items())
        text = (f"Indexed {self.samples} of {self.found} samples in {self.shards} tars ({splits}), "
                f"{len(manifest.classes)} classes; left out {len(samples)} ({count_reasons(samples)}). The tars "
                f"are unchanged; manifest: {manifest.location}/{MANIFEST_NAME}.")
        return "\n".join([text, *explained(samples), *(f"Note: {w}" for w in manifest.warnings)])

    def compressed_error(self) -> str | None:
        """The error line when compressed tars were left out (the command exits 1 after writing the rest)."""
        if not self.compressed:
            return None
        return (f"{len(self.compressed)} compressed tar(s) not indexed ({first_few(list(self.compressed))}): DALI "
                f"reads only uncompressed tars; the other tars are indexed. Decompress each, then run index "
                f"again: {first_few(list(self.compressed.values()), '; ')}")


# reasons whose count alone does not say what happened: the summary shows one whole
EXPLAINED = ("dotted key", "members not adjacent", "label unreadable")


def explained(skipped: list[dict]) -> list[str]:
    """For each reason of EXPLAINED among the `skipped` entries, its first entry in full."""
    lines = []
    for why in EXPLAINED:
        first = next((e for e in skipped if e["reason"].startswith(why + ":")), None)
        if first is not None:
            lines.append(f"{first['path']}: {first['reason']}")
    return lines


def first_few(items: list[str], sep: str = ", ", shown: int = 3) -> str:
    more = f"{sep}... ({len(items) - shown} more in the manifest's skipped)" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


def count_reasons(skipped: list[dict]) -> str:
    """`3 no label; 1 duplicate key`: the skipped entries counted by the reason's first words."""
    reasons = Counter(e["reason"].split(":")[0] for e in skipped)
    return "; ".join(f"{n} {r}" for r, n in reasons.most_common()) or "none"


def scan_split(folder: TarFolder, names: list[str], cfg: IndexConfig) -> list[ScannedTar]:
    """The split's tars read and judged, in order: `cfg.workers` tars at a time, each in a worker process;
    with --decode one tar at a time, its images decoded by `cfg.workers` processes (decoding is the work
    then, and a folder of one big tar gets every core)."""
    wanted = set(IMAGE_EXTS) | {cfg.label_member}
    if cfg.decode:
        tars = []
        for name in names:
            tar = read_tar_samples(folder, name, wanted, cfg, keep_images=True)
            leave_out_undecodable(tar, cfg)  # one tar's images held at a time
            tars.append(tar)
    else:
        read = partial(read_tar_samples, folder, wanted=wanted, cfg=cfg)
        tars = list(ordered_map(read, names, min(cfg.workers, len(names)), chunk=1))
    mark_keys_across_tars(tars)
    return tars


def leave_out_undecodable(tar: ScannedTar, cfg: IndexConfig) -> None:
    """Decode the image of every sample of `tar` judged usable (`cfg.workers` processes, as the conversion
    decodes: `images.decode_check`, PIL's full decode) and leave out those that do not decode, with PIL's
    reason; then drop the images. On the damage tried (a JPEG cut anywhere after its headers, a missing EOI)
    PIL and DALI's decoder reject the same files; `verify --decode` runs DALI's own."""
    usable = [s for s in tar.samples if s.reason is None]
    images = [s.data[image_member(s).ext] for s in usable]
    for sample, why in zip(usable, ordered_map(partial(decode_problem, max_pixels=cfg.max_pixels), images,
                                               cfg.workers)):
        if why is not None:
            sample.reason = f"{UNDECODABLE}: {why}"
    for sample in tar.samples:
        sample.data = {}


UNDECODABLE = "image undecodable"  # the reason's first words, which verify reads back from the manifest


def decode_problem(data: bytes, max_pixels: int) -> str | None:
    """Why `data` does not decode in full (runs in a worker process), or None."""
    try:
        decode_check(data, max_pixels)
    except ImageError as e:
        return str(e)
    return None


def tars_to_index(folder: TarFolder, forced_split: str | None) -> tuple[dict[str, list[str]], CompressedTars]:
    """The folder's tars by split, and its compressed tars; IndexDataError when there are compressed tars and
    nothing else to index, IndexUsageError when there are no tars at all."""
    names = folder.file_names()
    compressed = CompressedTars.find(names)
    tars = find_tars(names, forced_split)
    if tars:
        return tars, compressed
    if compressed.left_out:
        commands = compressed.commands(folder)
        raise IndexDataError(f"{folder.location}: nothing to index: {len(commands)} compressed tar(s) "
                             f"({first_few(list(commands))}) and no .tar; DALI reads only uncompressed tars: "
                             f"decompress them, then index again: {first_few(list(commands.values()), '; ')}")
    raise IndexUsageError(f"{folder.location}: no .tar files in it")


def index_folder(cfg: IndexConfig) -> ShardManifest:
    """Index every tar of `cfg.src` in place and write its manifest (last), beside the tars or in
    `cfg.index_dir`. The tars are only read."""
    folder = TarFolder(cfg.src)
    out = TarFolder(cfg.index_dir) if cfg.index_dir is not None else folder
    out.check_writable("give --index-dir DIR to write them elsewhere (the tars are read where they are)"
                       if out is folder else "give another --index-dir")
    refuse_converted_folder(out, None if out is folder else str(cfg.src.resolve()))
    tar_names, compressed = tars_to_index(folder, cfg.split)
    scanned = {split: scan_split(folder, names, cfg) for split, names in tar_names.items()}
    every = [s for tars in scanned.values() for tar in tars for s in tar.samples]
    classes = decide_classes([s.label for s in every if s.reason is None], cfg.classes_file)
    lookup = {name: i for i, name in enumerate(classes)}
    for sample in every:
        if sample.reason is None:
            sample.label, sample.reason = class_index(sample.label, classes, lookup)
    compressed_skipped = compressed.skipped(folder)
    if not any(s.reason is None for s in every):
        left_out = [{"path": f"{tar.name}:{s.key}", "reason": s.reason}
                    for tars in scanned.values() for tar in tars for s in tar.samples]
        raise IndexDataError(" ".join([f"{cfg.src}: no sample can be trained on: {len(every)} found, all left out ("
                                       f"{count_reasons(left_out + compressed_skipped)}).", *explained(left_out)]))
    splits, skipped, warnings, extensions = {}, [], compressed.notes(), {}
    for split, tars in scanned.items():
        info = SplitInfo(class_counts=[0] * len(classes))
        for tar in tars:
            skipped += [{"path": f"{tar.name}:{s.key}", "reason": s.reason} for s in tar.samples if s.reason]
            extensions[tar.name] = dict(sorted(Counter(m.ext for s in tar.samples for m in s.members).items()))
            kept = [s for s in tar.samples if s.reason is None]
            if not kept:  # DALI refuses an index without samples
                warnings.append(f"{tar.name}: no sample kept, left out of split {split!r}")
                continue
            for s in kept:
                info.class_counts[s.label] += 1
            info.shards.append(write_index(out, tar, kept_index_text(tar.samples, cfg)))
        if info.shards:
            splits[split] = info
    remote = folder.remote
    manifest = ShardManifest(
        root=Path(".") if remote else out.location, kind=KIND, source=cfg.src if remote else str(cfg.src.resolve()),
        options=cfg.to_json(), classes=classes, splits=splits, skipped=compressed_skipped + skipped,
        found=len(every) + len(compressed_skipped), warnings=warnings,
        extra={"webdataset": {"label": {"member": cfg.label_member, "key": cfg.label_key,
                                        "dali": dali_label(cfg)},
                              "extensions": extensions}},
        url=cfg.src if remote else None, tar_root=None if out is folder else cfg.src.resolve(),
    )
    out.write(MANIFEST_NAME, (json.dumps(manifest.to_json(), indent=2) + "\n").encode())  # last
    manifest.summary = IndexSummary(sum(i.samples for i in splits.values()), len(every),
                                    sum(len(i.shards) for i in splits.values()),
                                    {name: i.samples for name, i in splits.items()}, compressed.commands(folder))
    return manifest


def refuse_converted_folder(folder: TarFolder, tars: str | None = None) -> None:
    """A folder shard-convert wrote has a manifest richer than the one `index` would write over it; an
    --index-dir (`tars`: the tar folder it is for) may hold the index of those tars only."""
    text = folder.read_text(MANIFEST_NAME)
    try:
        doc = json.loads(text) if text else {}
        kind = doc.get("kind")
    except (ValueError, AttributeError):
        return  # not a manifest of ours: index writes one
    if kind not in (None, KIND):
        raise IndexUsageError(f"{folder.location}: already a dalifeed shard folder ({kind} shards written by "
                              f"shard-convert); there is nothing to index")
    if tars is not None and kind == KIND and doc.get("tars", doc.get("source")) != tars:
        raise IndexUsageError(f"--index-dir {folder.location}: holds the index of other tars "
                              f"({doc.get('tars', doc.get('source'))}); give each folder of tars its own --index-dir")


def dali_label(cfg: IndexConfig) -> dict:
    """How the graph reads the label (`dalifeed.pipelines.textlabels`): the `.cls` member's ASCII digits, or
    the digits at the end of the `dalifeed.label` component's index name."""
    if cfg.label_from_member:
        return {"ext": "cls", "from": "member"}
    return {"ext": NAME_LABEL_EXT, "from": "name", "digits": LABEL_DIGITS}


def index_name(tar_name: str) -> str:
    return tar_name[:-len(".tar")] + ".idx"


def write_index(folder: TarFolder, tar: ScannedTar, text: str) -> ShardInfo:
    """Write the tar's index beside it (`NAME.idx`) and describe both; the tar is read, never written."""
    data = text.encode()
    folder.write(index_name(tar.name), data)
    return ShardInfo(tar.name, index_name(tar.name), int(text.split(None, 2)[1]), tar.bytes, tar.sha256,
                     hashlib.sha256(data).hexdigest())


def verify_indexed_folder(manifest: ShardManifest, on_shard=lambda: None, decoder=None) -> list[str]:
    """Problems of an indexed folder, one line each: every tar's size and sha256 against the manifest (a tar
    changed since it was indexed), and every index against the one `index` writes now with the manifest's
    options (each tar is read once). With `decoder` (a DaliDecoder), every kept image is also decoded by PIL
    (as `index --decode` judges) and by DALI, as training would (`decode_problems`)."""
    opts = manifest.options
    folder = TarFolder(manifest.url or manifest.tar_root or manifest.root)  # the tars
    indexes = TarFolder(manifest.url or manifest.root)  # the indexes and the manifest
    cfg = IndexConfig(folder.location, opts.get("split"), opts.get("label_member", "cls"), opts.get("label_key"),
                      None, opts.get("max_pixels") or DEFAULT_MAX_PIXELS, workers=1)
    # `index --decode`'s verdicts, taken from the manifest rather than decoded again: a tar whose sha256 is
    # the manifest's holds the bytes they were made on
    undecoded = {e["path"]: e["reason"] for e in manifest.skipped if e["reason"].startswith(UNDECODABLE + ":")}
    lookup = {name: i for i, name in enumerate(manifest.classes)}
    again = f"index it again: {manifest.index_command()}"
    problems: list[str] = []
    for info in manifest.splits.values():
        undecodable: dict[tuple[str, str], str] = {}  # (tar, key) -> what the decoders say of its image
        try:
            tars = []
            for shard in info.shards:
                tar = read_tar_samples(folder, shard.path, set(IMAGE_EXTS) | {cfg.label_member}, cfg,
                                       keep_images=decoder is not None)
                for sample in tar.samples:
                    if sample.reason is None:
                        sample.reason = undecoded.get(f"{tar.name}:{sample.key}")
                if decoder is not None:  # one tar's images at a time
                    undecodable.update(decode_problems(tar, decoder, cfg.max_pixels,
                                                       manifest.index_command(decode=True)))
                tars.append(tar)
            mark_keys_across_tars(tars)
        except IndexDataError as e:
            problems.append(f"{e}; {again}")
            continue
        for shard, tar in zip(info.shards, tars):
            where = folder.where(tar.name)
            if (tar.bytes, tar.sha256) != (shard.bytes, shard.sha256):
                what = f"{tar.bytes} bytes, the manifest says {shard.bytes}" if tar.bytes != shard.bytes else \
                    "sha256 differs from the manifest"
                problems.append(f"{where}: {what} (changed since it was indexed: {again})")
                continue
            for sample in tar.samples:
                if sample.reason is None:
                    sample.label, sample.reason = class_index(sample.label, manifest.classes, lookup)
            text = indexes.read_text(shard.index)
            if text is None:
                problems.append(f"{indexes.where(shard.index)}: missing ({manifest.index_command()} writes it)")
            elif text != kept_index_text(tar.samples, cfg):
                problems.append(f"{indexes.where(shard.index)}: not the index of {tar.name} ({again})")
            for sample in tar.samples:
                why = undecodable.get((tar.name, sample.key))
                if sample.reason is None and why is not None:
                    problems.append(f"{where}: sample {sample.key}: {why}")
            on_shard()
    return problems


def decode_problems(tar: ScannedTar, decoder, max_pixels: int, reindex: str) -> dict[tuple[str, str], str]:
    """What is wrong with the image of each of the tar's samples judged usable, by (tar, key): DALI cannot
    decode it (a training run would stop there), PIL cannot (`index --decode` leaves such a sample out; DALI may
    decode it anyway, and training would read garbage), or DALI decodes it with libjpeg's warning of damaged
    data. The images are dropped from memory afterwards."""
    kept = [x for x in tar.samples if x.reason is None]
    images = [x.data[image_member(x).ext] for x in kept]
    warned: list[tuple[int, str]] = []
    dali = dict(decoder.failures(images, warnings=warned))
    libjpeg = dict(warned)
    found = {}
    for i, sample in enumerate(kept):
        pil = decode_problem(images[i], max_pixels)
        if i in dali:
            found[(tar.name, sample.key)] = f"DALI cannot decode its image ({dali[i]}): a training run would stop here"
        elif pil is not None:
            said = f" and DALI's libjpeg warns '{libjpeg[i]}'" if i in libjpeg else ""
            found[(tar.name, sample.key)] = (f"PIL cannot decode its image ({pil}){said}; DALI decodes it, so "
                                             f"training would read what it makes of it: leave it out with: {reindex}")
        elif i in libjpeg:
            found[(tar.name, sample.key)] = (f"DALI's libjpeg warns '{libjpeg[i]}': its image data are damaged, and "
                                             f"training would read what libjpeg makes of them")
    for sample in tar.samples:
        sample.data = {}
    return found
