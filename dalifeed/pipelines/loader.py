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
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import torch
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from dalifeed.format import ShardInfo, ShardManifest
from dalifeed.s3 import StorageError
from dalifeed.shardfolder import check_split, open_shard_folder

from .budget import thread_budget
from .checks import (VERIFY_HINT, DaliDecoder, SampleRef, ShardDataError, dali_sees_gpu, find_undecodable,
                     index_named_in, indexed_samples, sample_named_in, summarize_dali_error, tar_of_index)
from .graphs import DEFAULT_HW_DECODER_LOAD, DEVICES, AugmentConfig, shard_pipeline, uses_gpu

SHARD_CHECKS = ("size", "sha256")


def resolve_device(device: str) -> str:
    """'auto' -> 'gpu' when both torch and DALI can use a CUDA device, else 'cpu'. 'hybrid' (decode on the
    CPU, the rest on the GPU) needs a GPU as 'gpu' does."""
    if device not in ("auto", "cuda", *DEVICES):
        raise ValueError(f"device must be 'auto', 'cpu', 'gpu' or 'hybrid', got {device!r}")
    if device == "cuda":
        device = "gpu"
    if device == "auto":
        return "gpu" if torch.cuda.is_available() and dali_sees_gpu() else "cpu"
    if uses_gpu(device) and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device")
    return device


class DaliLoader:
    """An iterable of `(images, labels)`: images float (B, 3, H, W) or (B, H, W, 3) normalised, labels int64
    (B,), both on the GPU for devices 'gpu' and 'hybrid', on the CPU for 'cpu'. See the module docstring for
    epochs."""

    def __init__(self, manifest: ShardManifest, split: str, batch_size: int, *, train: bool, rank: int,
                 world_size: int, seed: int, device: str, augment: AugmentConfig, num_threads: int,
                 prefetch_queue_depth: int, initial_fill: int, device_id: int | None, checkpointing: bool = False,
                 check: str = "size", multilabel: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.manifest, self.split, self.batch_size, self.train = manifest, split, batch_size, train
        self.rank, self.world_size, self.seed, self.device, self.augment = rank, world_size, seed, device, augment
        self.num_threads, self.prefetch_queue_depth, self.initial_fill = num_threads, prefetch_queue_depth, initial_fill
        self.device_id, self.checkpointing = device_id, checkpointing
        self.multilabel_classes = manifest.num_classes if multilabel else 0
        self._shards = manifest.split_info(split).shards
        self.total_samples = manifest.num_samples(split)
        if self.total_samples == 0:
            raise ValueError(f"{manifest.root}: split {split!r} has no samples")
        if train and self.total_samples // world_size < batch_size:
            raise ValueError(f"split {split!r} has {self.total_samples} samples: too few for batch {batch_size} "
                             f"on each of {world_size} ranks (training drops partial batches)")
        check_files(manifest, split, check)
        self.epoch = 0
        self._iterator = None  # the current epoch's, from its build to its end; None between epochs
        self._batches_done = 0  # handed out in the current epoch
        self._restore: str | None = None  # a DALI checkpoint the next iteration starts from

    # -- sizes -------------------------------------------------------------------------------------
    def _shard_range(self, shard_id: int) -> tuple[int, int]:
        # DALI's split of N samples into `world_size` contiguous shards
        n, w = self.total_samples, self.world_size
        return n * shard_id // w, n * (shard_id + 1) // w

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (training: only those in full batches)."""
        if self.train:
            return len(self) * self.batch_size
        start, end = self._shard_range(self.rank)
        return end - start

    def __len__(self) -> int:
        if self.train:
            return (self.total_samples // self.world_size) // self.batch_size
        return -(-self.num_samples // self.batch_size)

    # -- epochs ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields epoch `epoch` (its order depends only on seed and epoch)."""
        self.epoch = epoch

    def state_dict(self) -> dict:
        """This rank's place in the data: the epoch and, between two batches of an epoch, how many were handed
        out and DALI's checkpoint after the last of them (only with `checkpointing=True`)."""
        if self._iterator is None or self._batches_done == 0:  # between epochs, or none handed out yet
            return {"epoch": self.epoch, "batches_done": 0, "dali": None}
        if not self.checkpointing:
            raise RuntimeError("a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        return {"epoch": self.epoch, "batches_done": self._batches_done, "dali": self._iterator.checkpoints()[0]}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration continues from `state` (from `state_dict()` of a loader with the same
        arguments, possibly in another process)."""
        if state["dali"] is not None and not self.checkpointing:
            raise ValueError("restoring a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        self.epoch, self._batches_done, self._restore = state["epoch"], state["batches_done"], state["dali"]

    def _epoch_shards(self) -> list[ShardInfo]:
        if not self.train:
            return list(self._shards)
        order = list(range(len(self._shards)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)  # same on every rank: a partition
        return [self._shards[i] for i in order]

    def _epoch_files(self) -> tuple[list[str], list[str]]:
        shards = self._epoch_shards()
        root = self.manifest.root  # a store's indexes are in the cache (check_files fetched them), its tars not
        return [self.manifest.shard_location(s) for s in shards], [str(root / s.index) for s in shards]

    outputs = ("images", "labels")  # what the pipeline returns, in order

    def _pipeline(self, tars: list[str], indexes: list[str], **pipeline_args):
        return shard_pipeline(tars, indexes, self.augment, self.train, self.device,
                              multilabel_classes=self.multilabel_classes, **pipeline_args)

    def pipeline(self, checkpoint: str | None = None):
        """The DALI pipeline of the current epoch, defined but not built (building is what needs the GPU:
        tests/test_gpu_graphs.py checks the GPU graphs on a machine without one through this)."""
        tars, indexes = self._epoch_files()
        return self._pipeline(
            tars, indexes, shard_id=self.rank, num_shards=self.world_size,
            initial_fill=self.initial_fill, batch_size=self.batch_size, num_threads=self.num_threads,
            device_id=self.device_id, seed=self._pipeline_seed(), prefetch_queue_depth=self.prefetch_queue_depth,
            enable_checkpointing=self.checkpointing, checkpoint=checkpoint,
            # Said, not assumed: DALI 2.4's iterator hands out its buffers without a copy only under the
            # dynamic executor (plugin/pytorch: `copy = not pipe.exec_dynamic`), and the detection graph reads
            # `.shape()` of GPU nodes on the CPU, which only it allows. It is DALI's default only while
            # exec_async and exec_pipelined are on and the prefetch queues are not split (pipeline.py).
            exec_dynamic=True,
        )

    def _build_iterator(self, checkpoint: str | None = None) -> DALIGenericIterator:
        pipe = self.pipeline(checkpoint)
        pipe.build()
        policy = LastBatchPolicy.DROP if self.train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator([pipe], list(self.outputs), reader_name="Reader", last_batch_policy=policy,
                                   last_batch_padded=False, auto_reset=False)

    def _pipeline_seed(self) -> int:
        # distinct per rank (different augmentations) and per epoch; below 2**31 as DALI requires
        return random.Random(f"{self.seed}:{self.epoch}:{self.rank}").randrange(2**31)

    def __iter__(self):
        restore, self._restore = self._restore, None
        if restore is None:
            self._batches_done = 0
        try:
            # A pipeline per epoch: training's order is a function of (seed, epoch) that the reader is given
            # at build time, and between epochs no pipeline is held (see the module docstring).
            self._iterator = None  # free the pipeline of an epoch left unfinished first
            self._iterator = self._build_iterator(restore)  # runs the first batches already
            limit = len(self)
            for batch in self._iterator:
                if self._batches_done < limit:
                    self._batches_done += 1
                    yield self._to_torch(batch[0])
        except Exception as e:
            # DALI 2.4 raises an operator's failure as the operator's own type (RuntimeError from a decoder,
            # IndexError from an axis out of range, ...), always with "Critical error in pipeline" (while
            # running) or "Critical error when building pipeline" (a reader's first read); anything else is a bug
            if "Critical error" not in str(e):
                raise
            self._iterator = None  # a pipeline that failed is not reused
            raise self._explain(e) from e
        # the epoch is over: free the pipeline (its threads, decoder state and buffers go back to DALI's
        # pools) so that the next loader to run, validation's or the next epoch's, does not sit beside it
        self._iterator = None
        self.epoch += 1

    # -- when DALI fails ---------------------------------------------------------------------------
    def _explain(self, error: Exception) -> ShardDataError | StorageError:
        """One line for a failed pipeline: the tar, and the sample when DALI names it or a re-decode of what
        this rank had read finds it; or what DALI's S3 client met."""
        tars, indexes = self._epoch_files()
        summary = summarize_dali_error(error)
        named, bad_index = sample_named_in(summary), index_named_in(summary)
        if self.manifest.url and (summary.startswith("S3 ") or "curlCode" in summary):  # the store, not the data
            detail = " ".join(str(error).rsplit("encountered:", 1)[-1].split("Current pipeline object")[0].split())
            return StorageError(f"{self.manifest.location}: DALI could not read from the store: "
                                f"{detail.lstrip(': ')}")
        if named:
            tar, key, ext = named
            line = f"{tar}: sample {key}: DALI cannot decode its .{ext}"
        elif bad_index:
            idx, detail = bad_index
            line = f"{tar_of_index(idx, tars, indexes)}: does not match its index {Path(idx).name} ({detail}): " \
                   f"the tar is truncated or was replaced"
        else:
            decoder = DaliDecoder(self.device, self.device_id, num_threads=self.num_threads)
            found = find_undecodable(self._suspects(), decoder)
            if found:
                ref, why = found
                line = f"{ref.tar}: sample {ref.key}: DALI cannot decode its .{ref.ext} ({why})"
            else:
                line = f"{self.manifest.location}: DALI failed reading split {self.split!r} ({summary})"
        return ShardDataError(f"{line}; {VERIFY_HINT.format(root=self.manifest.location)}")

    def _suspects(self):
        """This rank's samples of the epoch that DALI may have read before it failed, most recently read
        first: the reader reads its slice in file order, a batch draws from a shuffle buffer of
        `initial_fill` samples, and the pipeline runs `prefetch_queue_depth` batches ahead."""
        start, end = self._shard_range(self.rank)
        read = (self._batches_done + self.prefetch_queue_depth + 3) * self.batch_size + self.initial_fill
        window: list[SampleRef] = []
        position = 0
        for shard in self._epoch_shards():
            if position >= end:
                break
            if position + shard.samples > start:
                tar, idx = self.manifest.shard_location(shard), str(self.manifest.root / shard.index)
                refs = list(indexed_samples(tar, idx))
                window += refs[max(0, start - position):end - position]
            position += shard.samples
        read = min(read, len(window))
        yield from reversed(window[:read])
        yield from window[read:]

    def _to_torch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        images = batch["images"]
        if self.augment.channels_last:
            # DALI wrote NHWC; as a permuted view it is an NCHW tensor in channels_last memory format,
            # which is what a channels_last model consumes, with no copy.
            images = images.permute(0, 3, 1, 2)
        labels = batch["labels"]
        return images, labels if self.multilabel_classes else labels.view(-1)


def make_loader(shards_dir: str | os.PathLike, split: str, batch_size: int, *, rank: int = 0, world_size: int = 1,
                seed: int = 0, device: str = "auto", image_size: int = 224, train: bool | None = None,
                crop_scale: tuple[float, float] = (0.08, 1.0), flip: bool = True,
                dtype: torch.dtype = torch.float32, channels_last: bool = False, num_threads: int | None = None,
                prefetch_queue_depth: int = 2, initial_fill: int = 1024, device_id: int | None = None,
                checkpointing: bool = False, check: str = "size", multilabel: bool = False,
                hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, augment: AugmentConfig | None = None) -> DaliLoader:
    """Batches of split `split` of the shard folder `shards_dir` (a path, or s3://bucket/prefix: DALI then reads
    the tars from the store, docs/storage.md) for this rank; see the module docstring.

    `device`: 'auto' (GPU when torch and DALI see one), 'gpu' (nvJPEG decode, GPU augmentation), 'hybrid' (CPU
    decode, GPU augmentation: for when the GPU's decoder is the bottleneck) or 'cpu'. `hw_decoder_load`:
    with 'gpu', the share of JPEGs given to the hardware decoder of A100/H100-class GPUs (the rest go to CUDA
    cores; ignored where there is none). `device_id` defaults to the current CUDA device (set it from
    LOCAL_RANK under torchrun). `dtype` float32 or float16; `channels_last` gives
    NHWC. `num_threads`: DALI threads of the pipeline; default: this rank's share of the CPUs the process
    may use, capped (`dalifeed.pipelines.budget`: 4 with GPU decoding, 16 with CPU decoding).
    `checkpointing` enables DALI's checkpointing so that `state_dict()` can be taken mid-epoch (see the
    module docstring). `check`: what is compared with the manifest before reading, 'size' (sizes and
    indexes: two stats and two small reads per shard) or 'sha256' (also hashes every byte of the split).
    `multilabel` (COCO shards): labels are float multi-hot (B, num_classes) vectors of the categories each
    image holds, built in the DALI graph. `augment`: the whole AugmentConfig (policies, random erasing;
    docs/pipelines.md) instead of image_size, crop_scale, flip and hw_decoder_load; dtype and channels_last
    still decide the output.
    """
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
    manifest = open_shard_folder(shards_dir)  # a folder, or s3://bucket/prefix
    if multilabel and manifest.kind != "coco":
        raise ValueError(f"{shards_dir}: multi-label targets need COCO shards (.labels.i32 members), "
                         f"this is {manifest.kind}")
    if not multilabel and manifest.kind == "coco":  # DALI would fail on the missing one-class label member
        raise ValueError(f"{shards_dir}: COCO shards: use multilabel=True (dali-train --task multilabel) or "
                         f"make_detection_loader")
    resolved = resolve_device(device)
    if uses_gpu(resolved) and device_id is None:
        device_id = torch.cuda.current_device()
    augment = dataclasses.replace(
        augment or AugmentConfig(image_size=image_size, crop_scale=tuple(crop_scale), flip=flip,
                                 hw_decoder_load=hw_decoder_load),
        fp16=dtype == torch.float16, channels_last=channels_last)
    threads = num_threads or thread_budget(resolved).threads
    return DaliLoader(manifest, split, batch_size, train=split == "train" if train is None else train, rank=rank,
                      world_size=world_size, seed=seed, device=resolved, augment=augment, num_threads=threads,
                      prefetch_queue_depth=prefetch_queue_depth, initial_fill=initial_fill,
                      device_id=device_id if uses_gpu(resolved) else None, checkpointing=checkpointing, check=check,
                      multilabel=multilabel)


def check_files(manifest: ShardManifest, split: str, check: str) -> None:
    """Refuse, in one line, a split whose files disagree with its manifest (see `make_loader`'s `check`)."""
    if check not in SHARD_CHECKS:
        raise ValueError(f"check must be one of {', '.join(SHARD_CHECKS)}, got {check!r}")
    problems = check_split(manifest, split, sha256=check == "sha256")  # on disk, or HEADs in a store
    if problems:
        more = f" (and {len(problems) - 1} more: see shard-convert verify)" if len(problems) > 1 else ""
        raise ShardDataError(f"{problems[0]}{more}; {VERIFY_HINT.format(root=manifest.location)}")
