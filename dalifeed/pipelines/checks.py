"""Which shard, which sample: turning DALI's failures into one line a user can act on.

DALI reports a failed decode as a multi-line "Critical error in pipeline" that often names no sample
("nvImageCodec failure: '#4'"), and a truncated tar as a malformed *index*. This module holds what the
loader needs to say instead "<tar>: sample <key>: <what>": `find_undecodable` (the first sample among a
range of shard samples, read through their indexes, that DALI's decoder rejects) and `explain_dali_error`,
which puts it together with DALI's own line into the one line every loader raises. The decoder and that
line, `DaliDecoder` and `summarize_dali_error`, live in `dalifeed/decode.py`, below both this package and
`convert/` (`shard-convert verify --decode` runs the same decoder).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dalifeed.decode import DaliDecoder, summarize_dali_error
from dalifeed.format import index_samples, split_member_name
from dalifeed.s3 import StorageError

VERIFY_HINT = "check the shards with: shard-convert verify --decode {root}"

_SAMPLE_SOURCE = re.compile(r"(?P<tar>\S+?\.tar):(?P<offset>\d+):(?P<member>[^\s:]+)")
_BAD_INDEX = re.compile(r'Malformed index file at "(?P<idx>[^"]+)"(?P<detail>[^\n]*)')


class ShardDataError(Exception):
    """The data cannot be read as the manifest describes it; the message is one line naming the shard file
    (and the sample, where known) and what to run. The DALI error, if any, is the `__cause__`."""


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
    for entries in index_samples(idx):
        for ext, offset, size, name in entries:
            if ext == image_ext:
                yield SampleRef(tar, member_key(name), ext, offset, size)


def member_key(name: str) -> str:
    """The sample key of an index entry's member name (an index lists members of samples only)."""
    named = split_member_name(name)
    return named[0] if named else name


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


def mapping_budget() -> int:
    """The tar mappings DALI's readers may reserve in one process, DALI's rule (dali/util/mmaped_file.cc,
    `dali_max_mv_cnt`): half of the kernel's `vm.max_map_count`. A reader whose tars do not fit reads each
    through a file it keeps open for the pipeline's life: one descriptor per tar."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text()) // 2
    except (OSError, ValueError):
        return 0


class OpenFileLimit(OSError):
    """DALI could not open a file because this process has as many open as its limit allows (EMFILE): the
    message says the limit and how to raise it; the shards are not at fault."""


def open_file_limit(split: str, tars: int) -> OpenFileLimit:
    """The one line for a pipeline of `split` (over `tars` tars) that met this process's open-file limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    how = f"ulimit -n {hard_text}" if hard != soft else "its hard limit first: limits.conf, docker run --ulimit nofile"
    return OpenFileLimit(
        f"DALI ran out of open files reading split {split!r} ({tars} tars): this process may open {soft} files "
        f"(hard limit {hard_text}). Raise the limit before the run ({how}), or vm.max_map_count: DALI maps up to "
        f"{mapping_budget()} tars per process and keeps each tar past that open")


def explain_dali_error(error: BaseException, *, location: str, split: str, remote: bool, tars: list[str],
                       indexes: list[str], suspects: Iterable[SampleRef], decoder: DaliDecoder,
                       reindex: str | None = None) -> ShardDataError | StorageError | OpenFileLimit:
    """One line for a pipeline that failed reading split `split` of the shard folder at `location` (`remote`:
    an s3:// one) from `tars` with `indexes`: the tar, and the sample when DALI names it or a re-decode of
    `suspects` (the samples the reader may have reached, most likely first) with `decoder` finds it; or what
    DALI's S3 client met. `reindex`: for tars `shard-convert index` adopted, its command with --decode, which
    leaves an undecodable sample out of the index (the tars stay as they are): what the line then says to run."""
    summary = summarize_dali_error(error)
    if "Too many open files" in summary:  # EMFILE: the process's limit, not the data
        return open_file_limit(split, len(tars))
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


def explain_epoch_failure(error: BaseException, plan, options, epoch: int, batches_done: int) -> Exception:
    """`explain_dali_error` for a loader whose epoch `epoch` of `plan` (plan.EpochPlan) failed after
    `batches_done` batches: the samples this rank may have read first among the suspects."""
    manifest = plan.manifest
    shards = plan.epoch_shards(epoch)
    tars, indexes = plan.epoch_files(shards, epoch)
    return explain_dali_error(
        error, location=manifest.location, split=options.split, remote=bool(manifest.url), tars=tars,
        indexes=indexes, suspects=suspects(plan, options, batches_done, shards, tars, indexes),
        decoder=DaliDecoder(options.device, options.device_id, num_threads=options.num_threads),
        reindex=manifest.index_command(decode=True))


def suspects(plan, options, batches_done: int, shards: list, tars: list[str],
             indexes: list[str]) -> Iterator[SampleRef]:
    """This rank's samples of the epoch (`shards` read from `tars` with `indexes`) that DALI may have read
    before it failed, most recently read first: the reader reads its slice in file order, a batch draws from a
    shuffle buffer of `initial_fill` samples, and the pipeline runs `prefetch_queue_depth` batches ahead."""
    start, end = plan.shard_range(options.rank)
    read = (batches_done + options.prefetch_queue_depth + 3) * options.batch_size + options.initial_fill
    window: list[SampleRef] = []
    position = 0
    for shard, tar, idx in zip(shards, tars, indexes):
        if position >= end:
            break
        if position + shard.samples > start:
            window += list(indexed_samples(tar, idx))[max(0, start - position):end - position]
        position += shard.samples
    read = min(read, len(window))
    yield from reversed(window[:read])
    yield from window[read:]
