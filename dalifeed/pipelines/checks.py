"""Which shard, which sample: turning DALI's failures into one line a user can act on.

DALI reports a failed decode as a multi-line "Critical error in pipeline" that often names no sample
("nvImageCodec failure: '#4'"), and a truncated tar as a malformed *index*. This module holds what the
loader and `shard-convert verify --decode` need to say instead "<tar>: sample <key>: <what>":
`summarize_dali_error` (the one informative line of DALI's message), `DaliDecoder` (DALI's own decoder
run over given encoded images, bisecting a failing batch down to the samples it rejects),
`find_undecodable` (the first such sample among a range of shard samples, read through their indexes) and
`explain_dali_error`, which puts them together into the one line every loader raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from dalifeed.format import split_member_name
from dalifeed.s3 import StorageError

from .budget import thread_budget

VERIFY_HINT = "check the shards with: shard-convert verify --decode {root}"

# nvImageCodec's status codes (nvimgcodecStatus_t), as DALI prints them: "nvImageCodec failure: '#4'"
NVIMGCODEC_STATUS = {3: "bad code stream", 4: "code stream unsupported", 5: "allocator failure",
                     6: "execution failed", 8: "internal error", 9: "implementation unsupported"}

_SAMPLE_SOURCE = re.compile(r"(?P<tar>\S+?\.tar):(?P<offset>\d+):(?P<member>[^\s:]+)")
_BAD_INDEX = re.compile(r'Malformed index file at "(?P<idx>[^"]+)"(?P<detail>[^\n]*)')


def dali_sees_gpu() -> bool:
    """Whether DALI can use a CUDA device here (without importing torch)."""
    from dalifeed.stack import dali_stack

    return dali_stack()[3] > 0


class ShardDataError(Exception):
    """The data cannot be read as the manifest describes it; the message is one line naming the shard file
    (and the sample, where known) and what to run. The DALI error, if any, is the `__cause__`."""


def summarize_dali_error(error: BaseException) -> str:
    """The line of a DALI error that says what happened, without its pipeline traceback and boilerplate."""
    text = str(error)
    if "encountered:" in text:
        text = text.rsplit("encountered:", 1)[1]
    lines = [line.strip() for line in text.splitlines()]
    keep = [line for line in lines if line and not line.startswith(("Current pipeline object", "C++ context",
                                                                     "Critical error", "File \""))]
    summary = keep[0] if keep else lines[0] if lines else type(error).__name__
    summary = re.sub(r'^Assert on ".*?" failed: ', "", summary).rstrip(" :")
    code = re.search(r"nvImageCodec failure: '#(\d+)'", summary)
    if code and int(code.group(1)) in NVIMGCODEC_STATUS:
        summary += f" ({NVIMGCODEC_STATUS[int(code.group(1))]})"
    return summary


@dataclass(frozen=True)
class SampleRef:
    """Where one sample's image member lies: which tar (a path or an s3:// URL), its key, and the member's data
    offset and size."""

    tar: str
    key: str
    ext: str
    offset: int
    size: int

    def read(self) -> bytes:
        if self.tar.startswith("s3://"):
            from dalifeed.s3 import read_range

            return read_range(self.tar, self.offset, self.size)
        with open(self.tar, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


def indexed_samples(tar: str, idx: str, image_ext: str = "jpg") -> Iterator[SampleRef]:
    """The image member of every sample of `tar`, in order, from its DALI index (no tar scan)."""
    with open(idx) as f:
        next(f)  # "v1.2 N"
        for line in f:
            fields = line.split()
            for i in range(0, len(fields) - 3, 4):
                ext, offset, size, name = fields[i:i + 4]
                if ext == image_ext:
                    yield SampleRef(tar, member_key(name), ext, int(offset), int(size))


def member_key(name: str) -> str:
    """The sample key of an index entry's member name (an index lists members of samples only)."""
    named = split_member_name(name)
    return named[0] if named else name


class DaliDecoder:
    """DALI's image decoder (`mixed`, i.e. nvJPEG, on a GPU; libjpeg-turbo on the CPU) over encoded images
    handed in from Python, reporting the ones it rejects. The same decoder the training graphs use."""

    def __init__(self, device: str = "cpu", device_id: int | None = None, batch_size: int = 32,
                 num_threads: int | None = None):
        self.device, self.device_id, self.batch_size = device, device_id, batch_size
        self.num_threads = num_threads or thread_budget(device).threads
        self._pipe = None

    def pipeline(self):
        """The decoding pipeline, defined but not built (tests/test_gpu_graphs.py checks its GPU graph)."""
        from nvidia.dali import fn, pipeline_def, types

        from .graphs import decoder_device, decoder_hints

        @pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def decode():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(encoded, device=decoder_device(self.device), output_type=types.RGB,
                                     **decoder_hints(self.device, roi=False))

        return decode()

    def _build(self):
        pipe = self.pipeline()
        pipe.build()
        return pipe

    def _decode(self, items: list[bytes]) -> None:
        if self._pipe is None:
            self._pipe = self._build()
        self._pipe.feed_input("encoded", [np.frombuffer(item, np.uint8) for item in items])
        self._pipe.run()

    def failures(self, items: list[bytes]) -> list[tuple[int, str]]:
        """(index into `items`, DALI's reason) for every item DALI cannot decode, in index order."""
        found = [(i, "empty member") for i, item in enumerate(items) if not item]  # never handed to DALI
        positions = [i for i, item in enumerate(items) if item]
        for start in range(0, len(positions), self.batch_size):
            chunk = positions[start:start + self.batch_size]
            found += [(chunk[j], why) for j, why in self._bisect([items[i] for i in chunk])]
        return sorted(found)

    def _bisect(self, items: list[bytes]) -> list[tuple[int, str]]:
        try:
            self._decode(items)
            return []
        except RuntimeError as e:
            self._pipe = None  # a pipeline that raised is rebuilt, not trusted
            if len(items) == 1:
                return [(0, summarize_dali_error(e))]
        mid = len(items) // 2
        return self._bisect(items[:mid]) + [(mid + i, why) for i, why in self._bisect(items[mid:])]


def find_undecodable(samples: Iterable[SampleRef], decoder: DaliDecoder, chunk: int = 256) \
        -> tuple[SampleRef, str] | None:
    """The first sample (in the order given) DALI's decoder rejects, with the reason; None if all decode."""
    batch: list[SampleRef] = []
    for ref in samples:
        batch.append(ref)
        if len(batch) == chunk:
            found = _first_failure(batch, decoder)
            if found:
                return found
            batch = []
    return _first_failure(batch, decoder) if batch else None


def _first_failure(batch: list[SampleRef], decoder: DaliDecoder) -> tuple[SampleRef, str] | None:
    failures = decoder.failures([ref.read() for ref in batch])
    return (batch[failures[0][0]], failures[0][1]) if failures else None


def sample_named_in(summary: str) -> tuple[str, str, str] | None:
    """(tar path, sample key, member extension) when DALI's message names the sample, as its webdataset
    reader's source info "<tar>:<offset>:<member>"."""
    match = _SAMPLE_SOURCE.search(summary)
    named = split_member_name(match["member"]) if match else None
    return (match["tar"], *named) if named else None


def index_named_in(summary: str) -> tuple[str, str] | None:
    """(index path, what DALI found wrong) for its "Malformed index file" errors."""
    match = _BAD_INDEX.search(summary)
    return (match["idx"], match["detail"].strip(" -")) if match else None


def tar_of_index(idx: str, tars: list[str], indexes: list[str]) -> str:
    return tars[indexes.index(idx)] if idx in indexes else str(Path(idx).with_suffix(".tar"))


def is_pipeline_failure(error: BaseException) -> bool:
    """Whether `error` is DALI reporting a failed pipeline. DALI 2.4 raises an operator's failure as the
    operator's own type (RuntimeError from a decoder, IndexError from an axis out of range, ...), always with
    "Critical error in pipeline" (while running) or "Critical error when building pipeline" (a reader's first
    read); anything else is not the data's fault."""
    return "Critical error" in str(error)


def explain_dali_error(error: BaseException, *, location: str, split: str, remote: bool, tars: list[str],
                       indexes: list[str], suspects: Iterable[SampleRef], decoder: DaliDecoder,
                       reindex: str | None = None) -> ShardDataError | StorageError:
    """One line for a pipeline that failed reading split `split` of the shard folder at `location` (`remote`:
    an s3:// one) from `tars` with `indexes`: the tar, and the sample when DALI names it or a re-decode of
    `suspects` (the samples the reader may have reached, most likely first) with `decoder` finds it; or what
    DALI's S3 client met. `reindex`: for tars `shard-convert index` adopted, its command with --decode, which
    leaves an undecodable sample out of the index (the tars stay as they are): what the line then says to run."""
    summary = summarize_dali_error(error)
    if remote and (summary.startswith("S3 ") or "curlCode" in summary):  # the store, not the data
        return StorageError(f"{location}: DALI could not read from the store: {_store_detail(error)}")
    undecodable = _named_sample_line(summary)
    line = None if undecodable else _bad_index_line(summary, tars, indexes)
    if not line and not undecodable:
        found = find_undecodable(suspects, decoder)
        undecodable = f"{found[0].tar}: sample {found[0].key}: DALI cannot decode its .{found[0].ext} ({found[1]})" \
            if found else None
    if undecodable and reindex:
        return ShardDataError(f"{undecodable}; leave the samples that do not decode out of the index (the tars "
                              f"are not changed): {reindex}")
    line = line or undecodable or f"{location}: DALI failed reading split {split!r} ({summary})"
    return ShardDataError(f"{line}; {VERIFY_HINT.format(root=location)}")


def _store_detail(error: BaseException) -> str:
    # DALI's S3 client's words, without the pipeline traceback that follows them, on one line
    detail = " ".join(str(error).rsplit("encountered:", 1)[-1].split("Current pipeline object")[0].split())
    return detail.lstrip(": ")


def _named_sample_line(summary: str) -> str | None:
    named = sample_named_in(summary)
    if not named:
        return None
    tar, key, ext = named
    return f"{tar}: sample {key}: DALI cannot decode its .{ext}"


def _bad_index_line(summary: str, tars: list[str], indexes: list[str]) -> str | None:
    bad_index = index_named_in(summary)
    if not bad_index:
        return None
    idx, detail = bad_index
    return f"{tar_of_index(idx, tars, indexes)}: does not match its index {Path(idx).name} ({detail}): " \
           f"the tar is truncated or was replaced"
