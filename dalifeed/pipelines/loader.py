"""`make_loader`: shards -> DALI pipeline -> DALI's PyTorch iterator -> `(images, labels)` torch batches.

Epoch semantics (what a trainer may rely on):

- Validation (`train=False`): every sample of the split is yielded exactly once per epoch across all
  ranks. Rank r reads DALI shard r (a contiguous 1/world of the samples); the last batch of a rank may be
  partial; padding (`pad_last_batch`) is trimmed by `LastBatchPolicy.PARTIAL` and never counted.
- Training (`train=True`): every rank yields exactly `len(loader)` = floor(floor(N / world) / batch) full
  batches, so no DDP rank waits on another at the end of an epoch. DALI's per-rank shards differ in size
  by one sample; a rank whose shard holds one more batch decodes it and drops it rather than hang the
  others (`LastBatchPolicy.DROP`, at most one batch per epoch).
- Shuffling: the epoch's order is a pure function of `(seed, epoch)`: the tar files are visited in a
  seeded permutation (so each rank gets a different slice every epoch) and DALI shuffles samples within
  a buffer of `initial_fill`. Iterating again starts the next epoch; `set_epoch(e)` jumps to epoch e, which
  is how a resumed run replays exactly the order an uninterrupted one would have seen.
- Bad data is one line: before reading, every shard of the split is checked against the manifest (size
  and index always, sha256 with `check="sha256"`); a sample DALI cannot decode, or a tar that does not
  match its index, raises `ShardDataError` naming the tar and, where it can be found, the sample key
  (with DALI's error as its cause), never DALI's multi-line pipeline traceback alone.
- Mid-epoch resume (`checkpointing=True`): `state_dict()` taken between batches holds DALI's checkpoint
  of the reader and random generators after the last batch handed out; a fresh loader given it by
  `load_state_dict` yields exactly the rest of that epoch, then carries on as usual. The reader
  fast-forwards through the tar index without decoding what was already seen.
- One pipeline per epoch: each iteration builds its DALI pipeline and frees it when the epoch ends, so a
  trainer's rank holds one pipeline at a time (training's while it trains, validation's while it
  evaluates) with its thread pool and decoder buffers. Why not one pipeline for all epochs: docs/gpu.md.

Which splits train: `train=None` (the default of `make_loader` and `make_detection_loader`) means a split
whose name starts with "train" trains (`train`, COCO's `train2017`, `training`, `trainval`) and any other
is read as validation (`val`, `val2017`, `test`, `mini`); `train=True` or `False` says it outright
(`trains`).

How it is put together (the shape of DALI's examples: a graph function plus an iterator): one `DaliLoader`
holds the epoch contract above and is given the DALI graph to run (`graphs.shard_pipeline` for
classification, `detection.detection_pipeline` for detection), the names of its outputs, and the function
that turns DALI's batch into what torch code takes (`images_and_labels`, `detection.targets_from_batch`);
how it reads (batch, rank, seed, device, threads, ...) is a `LoaderOptions`; where it is in the data
(epoch, batches handed out, the live iterator, a checkpoint to restore) is its `EpochState`. Which files an
epoch reads is `epoch_files` (the tar a path or s3:// URL, the index a local path), passed in as `files`.
"""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from dalifeed import defaults
from dalifeed.budget import thread_budget
from dalifeed.decode import DaliDecoder
from dalifeed.format import ShardInfo, ShardManifest, trains
from dalifeed.shardcache import shard_cache_of
from dalifeed.shardfolder import check_split, open_shard_folder
from dalifeed.stack import StackReport, choose_device, stack_report

from .checks import (VERIFY_HINT, SampleRef, ShardDataError, explain_dali_error, indexed_samples,
                     is_pipeline_failure)
from .graphs import DEFAULT_HW_DECODER_LOAD, DEVICES, AugmentConfig, shard_pipeline, uses_gpu

if TYPE_CHECKING:  # what make_loader returns for a list of folders (mixing imports this module)
    from .mixing import ConcatLoader, MixedLoader

SHARD_CHECKS = ("size", "sha256")
CLASSIFICATION_OUTPUTS = ("images", "labels")


def resolve_device(device: str, report: StackReport | None = None) -> str:
    """'auto' -> 'gpu' on a node with NVIDIA GPUs that torch and DALI can both use, 'cpu' on a node without;
    where the node has GPUs and the stack does not fit them, `StackMismatch` (one line with the fix), never a
    silent 'cpu'. 'hybrid' (decode on the CPU, the rest on the GPU) needs a GPU as 'gpu' does. `report` is
    this node's `stack.check` (probed when None): the rule is `stack.choose_device`, dali-train's too."""
    if device not in ("auto", "cuda", *DEVICES):
        raise ValueError(f"device must be 'auto', 'cpu', 'gpu' or 'hybrid', got {device!r}")
    if device == "cpu":
        return "cpu"
    return choose_device(device, stack_report() if report is None else report)


@dataclass(frozen=True)
class LoaderOptions:
    """How a `DaliLoader` reads, whatever its graph. `device` is resolved ('cpu', 'gpu' or 'hybrid');
    `device_id` None on the CPU (and, for a graph only defined, DALI's current device); `check` what is
    compared with the manifest before reading (`make_loader`)."""

    batch_size: int
    train: bool
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    device: str = "cpu"
    device_id: int | None = None
    num_threads: int = 1
    prefetch_queue_depth: int = 2
    initial_fill: int = 1024
    checkpointing: bool = False
    check: str = "size"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.check not in SHARD_CHECKS:
            raise ValueError(f"check must be one of {', '.join(SHARD_CHECKS)}, got {self.check!r}")


def loader_options(split: str, batch_size: int, *, train: bool | None, device: str, device_id: int | None,
                   num_threads: int | None, prefetch_queue_depth: int | None = None, **rest) -> LoaderOptions:
    """`LoaderOptions` from a factory's arguments: `train` by the split rule (`trains`), the device resolved
    (`resolve_device`), on a GPU the current CUDA device unless `device_id` says, the thread budget of
    this rank unless `num_threads` says, the device's prefetch depth unless `prefetch_queue_depth` says
    (defaults.py: NVIDIA's published 5 with `mixed` decoding, DALI's 2 otherwise); `rest` (rank,
    world_size, seed, ...) as given."""
    resolved = resolve_device(device)
    if uses_gpu(resolved) and device_id is None:
        device_id = torch.cuda.current_device()
    return LoaderOptions(batch_size, trains(split, train), device=resolved,
                         device_id=device_id if uses_gpu(resolved) else None,
                         num_threads=num_threads or thread_budget(resolved).threads,
                         prefetch_queue_depth=prefetch_queue_depth or defaults.prefetch_queue_depth(resolved), **rest)


def epoch_files(manifest: ShardManifest, shards: list[ShardInfo]) -> tuple[list[str], list[str]]:
    """Where DALI reads `shards` from, in order: the tars (paths, or s3:// URLs: DALI reads those from the
    store) and their indexes (local paths: a store's indexes are in the cache, `check_files` fetched them)."""
    return [manifest.shard_location(s) for s in shards], [str(manifest.root / s.index) for s in shards]


@dataclass
class EpochState:
    """Where a loader is in its data."""

    epoch: int = 0  # the epoch being read, or the next one to read between epochs
    batches_done: int = 0  # handed out in the current epoch
    iterator: DALIGenericIterator | None = None  # the current epoch's, from its build to its end; else None
    restore: str | None = None  # a DALI checkpoint the next iteration starts from


# graph(tars, indexes, *, train, device, **pipeline arguments) -> a DALI pipeline, defined, not built
Graph = Callable[..., Any]


class DaliLoader:
    """An iterable of torch batches of split `split` of `manifest`'s folder: `graph` (see `Graph`) run by
    DALI's PyTorch iterator, whose batch (a dict by `outputs`) `to_torch` converts. See the module docstring
    for epochs; `files` says where an epoch's shards are read from."""

    def __init__(self, manifest: ShardManifest, split: str, options: LoaderOptions, *, graph: Graph,
                 to_torch: Callable[[dict], Any], outputs: tuple[str, ...] = CLASSIFICATION_OUTPUTS,
                 files: Callable[[ShardManifest, list[ShardInfo]], tuple[list[str], list[str]]] = epoch_files):
        self.manifest, self.split, self.options = manifest, split, options
        self.graph, self.to_torch, self.outputs, self.files = graph, to_torch, outputs, files
        self._shards = manifest.split_info(split).shards
        self.total_samples = manifest.num_samples(split)
        if self.total_samples == 0:
            raise ValueError(f"{manifest.root}: split {split!r} has no samples")
        if options.train and self.total_samples // options.world_size < options.batch_size:
            raise ValueError(f"split {split!r} has {self.total_samples} samples: too few for batch "
                             f"{options.batch_size} on each of {options.world_size} ranks (training drops partial "
                             f"batches)")
        check_files(manifest, split, options.check)
        self.state = EpochState()

    # -- sizes -------------------------------------------------------------------------------------
    def _shard_range(self, shard_id: int) -> tuple[int, int]:
        # DALI's split of N samples into `world_size` contiguous shards
        n, w = self.total_samples, self.options.world_size
        return n * shard_id // w, n * (shard_id + 1) // w

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (training: only those in full batches)."""
        if self.options.train:
            return len(self) * self.options.batch_size
        start, end = self._shard_range(self.options.rank)
        return end - start

    def __len__(self) -> int:
        o = self.options
        if o.train:
            return (self.total_samples // o.world_size) // o.batch_size
        return -(-self.num_samples // o.batch_size)

    # -- epochs ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields epoch `epoch` (its order depends only on seed and epoch)."""
        self.state.epoch = epoch

    def state_dict(self) -> dict:
        """This rank's place in the data: the epoch and, between two batches of an epoch, how many were handed
        out and DALI's checkpoint after the last of them (only with `checkpointing=True`)."""
        state = self.state
        if state.iterator is None or state.batches_done == 0:  # between epochs, or none handed out yet
            return {"epoch": state.epoch, "batches_done": 0, "dali": None}
        if not self.options.checkpointing:
            raise RuntimeError("a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        return {"epoch": state.epoch, "batches_done": state.batches_done, "dali": state.iterator.checkpoints()[0]}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration continues from `state` (from `state_dict()` of a loader with the same
        arguments, possibly in another process)."""
        if state["dali"] is not None and not self.options.checkpointing:
            raise ValueError("restoring a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        mine = self.state
        mine.epoch, mine.batches_done, mine.restore = state["epoch"], state["batches_done"], state["dali"]

    def _epoch_shards(self, epoch: int | None = None) -> list[ShardInfo]:
        if not self.options.train:
            return list(self._shards)
        order = list(range(len(self._shards)))
        epoch = self.state.epoch if epoch is None else epoch
        random.Random(f"{self.options.seed}:{epoch}").shuffle(order)  # same on every rank: a partition
        return [self._shards[i] for i in order]

    shard_cache = None  # s3:// folders: the node's ShardCache (make_loader sets it), else DALI reads `files`

    def _epoch_files(self, shards: list[ShardInfo]) -> tuple[list[str], list[str]]:
        """`files` of this epoch's shards; from a store with a shard cache, the local copies of this rank's
        tars, fetched whole first (and the next epoch's started in the background: dalifeed/shardcache.py)."""
        if self.shard_cache is None:
            return self.files(self.manifest, shards)
        tars = self.shard_cache.epoch_files(shards, self._shard_range(self.options.rank),
                                            upcoming=self._epoch_shards(self.state.epoch + 1))
        return tars, [str(self.manifest.root / s.index) for s in shards]

    def _pipeline_seed(self) -> int:
        # distinct per rank (different augmentations) and per epoch; below 2**31 as DALI requires
        return random.Random(f"{self.options.seed}:{self.state.epoch}:{self.options.rank}").randrange(2**31)

    def pipeline(self, checkpoint: str | None = None):
        """The DALI pipeline of the current epoch, defined but not built (building is what needs the GPU:
        tests/test_gpu_graphs.py checks the GPU graphs on a machine without one through this)."""
        o = self.options
        tars, indexes = self._epoch_files(self._epoch_shards())
        return self.graph(
            tars, indexes, train=o.train, device=o.device, shard_id=o.rank, num_shards=o.world_size,
            initial_fill=o.initial_fill, batch_size=o.batch_size, num_threads=o.num_threads, device_id=o.device_id,
            seed=self._pipeline_seed(), prefetch_queue_depth=o.prefetch_queue_depth,
            enable_checkpointing=o.checkpointing, checkpoint=checkpoint,
            # Said, not assumed: DALI 2.4's iterator hands out its buffers without a copy only under the
            # dynamic executor (plugin/pytorch: `copy = not pipe.exec_dynamic`), and the detection graph reads
            # `.shape()` of GPU nodes on the CPU, which only it allows. It is DALI's default only while
            # exec_async and exec_pipelined are on and the prefetch queues are not split (pipeline.py).
            exec_dynamic=True,
        )

    def _build_iterator(self, checkpoint: str | None) -> DALIGenericIterator:
        pipe = self.pipeline(checkpoint)
        pipe.build()
        policy = LastBatchPolicy.DROP if self.options.train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator([pipe], list(self.outputs), reader_name="Reader", last_batch_policy=policy,
                                   last_batch_padded=False, auto_reset=False)

    def __iter__(self):
        state = self.state
        restore, state.restore = state.restore, None
        if restore is None:
            state.batches_done = 0
        try:
            # A pipeline per epoch: training's order is a function of (seed, epoch) that the reader is given
            # at build time, and between epochs no pipeline is held (see the module docstring).
            state.iterator = None  # free the pipeline of an epoch left unfinished first
            state.iterator = self._build_iterator(restore)  # runs the first batches already
            limit = len(self)
            for batch in state.iterator:
                if state.batches_done < limit:
                    state.batches_done += 1
                    yield self.to_torch(batch[0])
        except Exception as e:
            if not is_pipeline_failure(e):
                raise
            state.iterator = None  # a pipeline that failed is not reused
            raise self._explain(e) from e
        # the epoch is over: free the pipeline (its threads, decoder state and buffers go back to DALI's
        # pools) so that the next loader to run, validation's or the next epoch's, does not sit beside it
        state.iterator = None
        state.epoch += 1

    # -- when DALI fails ---------------------------------------------------------------------------
    def _explain(self, error: Exception) -> Exception:
        o = self.options
        shards = self._epoch_shards()
        tars, indexes = self._epoch_files(shards)
        return explain_dali_error(
            error, location=self.manifest.location, split=self.split, remote=bool(self.manifest.url), tars=tars,
            indexes=indexes, suspects=self._suspects(shards, tars, indexes),
            decoder=DaliDecoder(o.device, o.device_id, num_threads=o.num_threads),
            reindex=self.manifest.index_command(decode=True))

    def _suspects(self, shards: list[ShardInfo], tars: list[str], indexes: list[str]) -> Iterator[SampleRef]:
        """This rank's samples of the epoch (`shards` read from `tars` with `indexes`) that DALI may have read
        before it failed, most recently read first: the reader reads its slice in file order, a batch draws
        from a shuffle buffer of `initial_fill` samples, and the pipeline runs `prefetch_queue_depth` batches
        ahead."""
        o = self.options
        start, end = self._shard_range(o.rank)
        read = (self.state.batches_done + o.prefetch_queue_depth + 3) * o.batch_size + o.initial_fill
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


def images_and_labels(batch: dict, *, channels_last: bool, multilabel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The classification graph's batch -> `(images, labels)`: labels (B,) int64, or (B, K) multi-hot."""
    images = batch["images"]
    if channels_last:
        # DALI wrote NHWC; as a permuted view it is an NCHW tensor in channels_last memory format,
        # which is what a channels_last model consumes, with no copy.
        images = images.permute(0, 3, 1, 2)
    labels = batch["labels"]
    return images, labels if multilabel else labels.view(-1)


def classification_loader(manifest: ShardManifest, split: str, options: LoaderOptions, augment: AugmentConfig,
                          multilabel: bool = False) -> DaliLoader:
    """A `DaliLoader` of `(images, labels)`: images float (B, 3, H, W) or (B, H, W, 3) normalised, labels
    int64 (B,) (or float multi-hot (B, num_classes) with `multilabel`), both on the GPU for devices 'gpu' and
    'hybrid', on the CPU for 'cpu'."""
    classes = manifest.num_classes if multilabel else 0
    return DaliLoader(manifest, split, options, graph=partial(shard_pipeline, cfg=augment, multilabel_classes=classes,
                                                           text_label=manifest.dali_text_label),
                      to_torch=partial(images_and_labels, channels_last=augment.channels_last, multilabel=multilabel))


def make_loader(shards_dir: str | os.PathLike | list, split: str, batch_size: int, *, rank: int = 0, world_size: int = 1,
                seed: int = 0, device: str = "auto", image_size: int = 224, train: bool | None = None,
                crop_scale: tuple[float, float] = (0.08, 1.0), flip: bool = True,
                dtype: torch.dtype = torch.float32, channels_last: bool = False, num_threads: int | None = None,
                prefetch_queue_depth: int | None = None, initial_fill: int = 1024, device_id: int | None = None,
                checkpointing: bool = False, check: str = "size", multilabel: bool = False,
                hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, weights: list[float] | None = None,
                cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                augment: AugmentConfig | None = None) -> DaliLoader | MixedLoader | ConcatLoader:
    """Batches of split `split` of the shard folder `shards_dir` (a path, or s3://bucket/prefix: the tars are then
    fetched whole into the node's shard cache and DALI reads them there, docs/storage.md) for this rank; see the module docstring (`train=None`: the
    split trains if its name starts with "train").

    `device`: 'auto' (GPU when torch and DALI see one), 'gpu' (nvJPEG decode, GPU augmentation), 'hybrid' (CPU
    decode, GPU augmentation: for when the GPU's decoder is the bottleneck) or 'cpu'. `hw_decoder_load`:
    with 'gpu', the share of JPEGs given to the hardware decoder of A100/H100-class GPUs (the rest go to CUDA
    cores; ignored where there is none). `device_id` defaults to the current CUDA device (set it from
    LOCAL_RANK under torchrun). `dtype` float32 or float16; `channels_last` gives
    NHWC. `num_threads`: DALI threads of the pipeline; default: this rank's share of the CPUs the process
    may use, capped (`dalifeed.budget`: 6 with GPU decoding, 16 with CPU decoding).
    `prefetch_queue_depth`: batches DALI prepares ahead; default 5 with GPU decoding, 2 otherwise
    (`dalifeed.defaults`: NVIDIA's published configurations).
    `checkpointing` enables DALI's checkpointing so that `state_dict()` can be taken mid-epoch (see the
    module docstring). `check`: what is compared with the manifest before reading, 'size' (sizes and
    indexes: two stats and two small reads per shard) or 'sha256' (also hashes every byte of the split).
    `multilabel` (COCO shards): labels are float multi-hot (B, num_classes) vectors of the categories each
    image holds, built in the DALI graph. `augment`: the whole AugmentConfig (policies, random erasing;
    docs/pipelines.md) instead of image_size, crop_scale, flip and hw_decoder_load; dtype and channels_last
    still decide the output.
    Giving `augment` with an image_size, crop_scale, flip or hw_decoder_load other than their defaults is
    refused (ValueError): one of the two would be ignored.
    A list of shard folders mixes them (`weights`: their proportions in every batch, default equal;
    `dalifeed.pipelines.mixing` says how epochs, classes and resume work then): a `MixedLoader` for a
    training split, a `ConcatLoader` (each dataset in turn) otherwise; one folder gives a `DaliLoader`.
    `cache_dir`, `cache_limit` (s3:// only): the node's shard cache the tars are fetched into, whole, before
    DALI reads them (default: `shards/` in dalifeed's cache folder; limit in bytes or a size such as '20GB'
    (20 * 10^9) or '20GiB' (20 * 2^30), default 90% of the free space; see dalifeed/shardcache.py and docs/storage.md).
    """
    if isinstance(shards_dir, (list, tuple)):
        args = {k: v for k, v in locals().items() if k not in ("shards_dir", "split", "batch_size", "weights", "train")}
        from .mixing import make_mixed_loader

        return make_mixed_loader(list(shards_dir), split, batch_size, weights=weights, train=train, make_one=make_loader,
                                 **args)
    if weights is not None:
        raise ValueError(f"weights={weights} mixes a list of shard folders; {shards_dir} is one")
    if augment is not None:
        refuse_shadowed_options(image_size=image_size, crop_scale=tuple(crop_scale), flip=flip,
                                hw_decoder_load=hw_decoder_load)
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
    manifest = open_shard_folder(shards_dir)  # a folder, or s3://bucket/prefix
    if multilabel and manifest.kind != "coco":
        raise ValueError(f"{shards_dir}: multi-label targets need COCO shards (.labels.i32 members), "
                         f"this is {manifest.kind}")
    if not multilabel and manifest.kind == "coco":  # DALI would fail on the missing one-class label member
        raise ValueError(f"{shards_dir}: COCO shards: use multilabel=True (dali-train --task multilabel) or "
                         f"make_detection_loader")
    options = loader_options(split, batch_size, train=train, device=device, device_id=device_id,
                             num_threads=num_threads, rank=rank, world_size=world_size, seed=seed,
                             prefetch_queue_depth=prefetch_queue_depth, initial_fill=initial_fill,
                             checkpointing=checkpointing, check=check)
    augment = replace(
        augment or AugmentConfig(image_size=image_size, crop_scale=tuple(crop_scale), flip=flip,
                                 hw_decoder_load=hw_decoder_load),
        fp16=dtype == torch.float16, channels_last=channels_last)
    loader = classification_loader(manifest, split, options, augment, multilabel)
    cache = shard_cache_of(manifest, cache_dir, cache_limit, sha256=check == "sha256")
    if cache is not None:  # the first epoch's tars start coming while the caller gets ready
        loader.shard_cache = cache.prefetch(loader._epoch_shards(), loader._shard_range(rank))
    return loader


def refuse_shadowed_options(**given) -> None:
    """make_loader's keyword options that `augment=` replaces, refused when they differ from their defaults:
    the AugmentConfig would silently win over them."""
    defaults = inspect.signature(make_loader).parameters
    shadowed = [f"{name}={value!r}" for name, value in given.items()
                if value != (tuple(defaults[name].default) if name == "crop_scale" else defaults[name].default)]
    if shadowed:
        raise ValueError(f"{', '.join(shadowed)} with augment=: the AugmentConfig decides these; set them in it "
                         f"(dataclasses.replace(augment, ...))")


def check_files(manifest: ShardManifest, split: str, check: str) -> None:
    """Refuse, in one line, a split whose files disagree with its manifest (`check`: one of SHARD_CHECKS, see
    `make_loader`)."""
    problems = check_split(manifest, split, sha256=check == "sha256")  # on disk, or HEADs in a store
    if problems:
        more = f" (and {len(problems) - 1} more: see shard-convert verify)" if len(problems) > 1 else ""
        raise ShardDataError(f"{problems[0]}{more}; {VERIFY_HINT.format(root=manifest.location)}")
