"""`make_loader`: shards -> DALI pipeline -> DALI's PyTorch iterator -> `(images, labels)` torch batches.

The epoch contract a trainer may rely on (in full: docs/pipelines.md, "The loader's contract"):

- validation yields every sample of the split once per epoch across all ranks; training yields exactly
  `len(loader)` full batches on every rank, so no DDP rank waits on another at the end of an epoch;
- the epoch's order is a pure function of `(seed, epoch)`, and `set_epoch(e)` jumps to epoch e;
- bad data is one line: shards are checked against the manifest first, and `ShardDataError` names the tar;
- `state_dict()` / `load_state_dict` resume mid-epoch exactly, on as many ranks or (elastic.py) on others;
- each epoch reads through its own pipeline, made from one serialized definition and started ahead; CPU
  training may read in two lanes (lanes.py); progressive resizing (`size_schedule=`) keeps each epoch's size.

A split whose name starts with "train" trains (`train=None`, the default); any other is read as validation.

The parts: `DaliLoader` is the thin iterator with `state_dict`; what an epoch reads is its `plan.EpochPlan`;
its pipelines are made by `definitions.EpochDefinitions` from a graph function (`graphs.shard_pipeline`,
`detection.detection_pipeline`); where it is in the data is its `cursor.EpochCursor`; factory.py builds
loaders from a dataset and options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from nvidia.dali.plugin.pytorch import LastBatchPolicy

from dalifeed import defaults
from dalifeed.budget import thread_budget
from dalifeed.format import trains
from dalifeed.pipelines.shardcache import ShardCache
from dalifeed.stack import StackReport, choose_device, stack_report

from .augment import AugmentConfig
from .checks import explain_epoch_failure, is_pipeline_failure
from .cursor import EpochCursor, FollowsCursor
from .dataset import ShardData, Source
from .definitions import EpochDefinitions, Graph
from .elastic import ElasticError, SampleKeys, SampleSet, batches_left
from .epoch_iterator import EpochIterator
from .graphs import DEFAULT_HW_DECODER_LOAD, Output, shard_pipeline, uses_gpu
from .lanes import LaneBatches, mappings_fit
from .names import DEVICES
from .plan import EpochPlan, Files, epoch_files
from .ranks import FROM_ARGUMENTS, RANKS_FROM, check_given, local_gpu, resolve_ranks

CLASSIFICATION_OUTPUTS = ("images", "labels")
# The graph output naming each sample where it was read (`graphs.sample_sources`), taken off the batch before
# `to_torch`: a checkpointing training loader records with it which samples it has handed out (elastic.py).
SAMPLE_SOURCES = "sources"
# A mid-epoch state's mark that each lane's reader was given only its own tars (`EpochPlan.lane_files`)
OWN_TARS = "own_tars"


def resolve_device(device: str, report: StackReport | None = None) -> str:
    """The device a loader asked for `device` runs on, decided as every dalifeed command decides it.

    Args:
        device: `"auto"`, `"cpu"`, `"gpu"` or `"hybrid"` (decode on the CPU, the rest on the GPU; it needs a
            GPU as `"gpu"` does).
        report: This node's GPU stack (driver, torch's and DALI's CUDA builds, the GPUs), as `dalifeed
            doctor` reports it; None: probed now. Default None.

    Returns:
        `"cpu"`, `"gpu"` or `"hybrid"`: `"auto"` is `"gpu"` on a node with NVIDIA GPUs that torch and DALI can
        both use, `"cpu"` on a node without.

    Raises:
        ValueError: `device` is none of the four.
        StackMismatch: The node has GPUs that the installed torch or DALI cannot use (one line naming the
            fix); never a silent `"cpu"`.
    """
    if device not in ("auto", "cuda", *DEVICES):
        raise ValueError(f"device must be 'auto', 'cpu', 'gpu' or 'hybrid', got {device!r}")
    if device == "cpu":
        return "cpu"
    return choose_device(device, stack_report() if report is None else report)


@dataclass(frozen=True)
class LoaderOptions:
    """What a loader reads and how, whatever its graph: `make_loader`'s keyword options as one record,
    which a run prints and saves with its config. The values are checked when the record is made; `resolved()`
    decides every None and `"auto"` on this node, which is what a loader runs with.

    Example:
        ```python
        from dataclasses import asdict

        from dalifeed.pipelines import LoaderOptions, make_loader

        options = LoaderOptions("train", 256, seed=1, fp16=True)
        loader = make_loader("/data/shards", **asdict(options))
        ```

    Attributes:
        split: The split to read.
        batch_size: Samples per batch on each rank, at least 1.
        train: Read for training (shuffled, augmented, full batches only) or for validation (every sample
            once); None: training when the split's name starts with "train". Default None.
        rank: This process's rank, 0 to `world_size - 1`: which part of the split it reads; None (given
            together with `world_size` or not at all): the launcher's, from an initialized process group, else
            torchrun's `RANK`, else srun's `SLURM_PROCID`, else 0. Given, it wins over the environment; given
            values that disagree with an initialized process group raise ValueError, but for a data-parallel
            subgroup's (a `world_size` above 1 dividing the group's size). Default None.
        world_size: The number of processes reading the split together; None: the launcher's
            (`get_world_size()`, `WORLD_SIZE`, `SLURM_STEP_NUM_TASKS`, else 1). Default None.
        seed: Seeds the shuffle and the augmentations: an epoch's order depends on `(seed, epoch)` alone.
            Default 0.
        device: Where images are decoded and processed: `"cpu"`, `"gpu"` (nvJPEG and the hardware decoder,
            the rest on the GPU), `"hybrid"` (decoded on the CPU, the rest on the GPU) or `"auto"` (the GPU
            when torch and DALI can both use one; on a node whose GPUs they cannot use, an error naming the
            fix, never a silent CPU). Default `"auto"`.
        device_id: The CUDA device index on a GPU; None: torchrun's `LOCAL_RANK` where torch's current
            device was left at 0 and that GPU is visible, else torch's current device. Default None.
        num_threads: DALI CPU threads of this loader; None: this rank's share of the CPUs this process may
            use (those on the node divided by its ranks, capped). Default None.
        prefetch_queue_depth: Batches each pipeline prepares ahead; None: 5 for `"gpu"` (NVIDIA's
            published setting with GPU decoding), DALI's 2 otherwise. Default None.
        initial_fill: Training: the size in samples of DALI's shuffle buffer, which shuffles within
            the globally shuffled shards. Default 1024.
        checkpointing: Keep DALI's reader state, so that `state_dict()` can save a position inside an epoch
            and `load_state_dict()` resume from it. Default False.
        lanes: Pipelines that share this rank's epoch and its threads, handing out whole batches in turn;
            None: 2 for CPU training with 2 threads or more and epochs of 24 batches or more, else 1.
            Default None.
        fp16: Hand out float16 images instead of float32. Default False.
        channels_last: Hand out images in NHWC memory as channels_last NCHW tensors (no copy), for a
            channels_last model. Default False.
        hw_decoder_load: With `"gpu"`: the share of JPEGs, 0 to 1, given to the hardware JPEG decoder of
            A100/H100-class GPUs (the rest decode on CUDA cores). Default 0.99.
        ranks_from: Which source `resolved()` took `rank` and `world_size` from: `"arguments"`,
            `"process group"`, `"environment (RANK/WORLD_SIZE)"`, `"environment
            (SLURM_PROCID/SLURM_STEP_NUM_TASKS)"` or `"default"`; None before. Default None.
        epochs: The run's number of epochs; None: no end known. A training loader starts no pipeline of
            epoch `epochs` or later ahead of time, so the last epoch leaves none behind it. Default None.

    Raises:
        ValueError: A value out of range, named.
    """

    split: str
    batch_size: int
    train: bool | None = None
    rank: int | None = None
    world_size: int | None = None
    seed: int = 0
    device: str = "auto"
    device_id: int | None = None
    num_threads: int | None = None
    prefetch_queue_depth: int | None = None
    initial_fill: int = 1024
    checkpointing: bool = False
    lanes: int | None = None
    fp16: bool = False
    channels_last: bool = False
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD
    ranks_from: str | None = None
    epochs: int | None = None

    def __post_init__(self) -> None:
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.lanes is not None and self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if self.ranks_from not in (None, *RANKS_FROM):
            raise ValueError(f"ranks_from must be one of {', '.join(map(repr, RANKS_FROM))}, got {self.ranks_from!r}")
        check_given(self.rank, self.world_size)
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            source = f" (from {self.ranks_from})" if self.ranks_from not in (None, FROM_ARGUMENTS) else ""
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}"
                             f"{source}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        Output(self.fp16, self.channels_last, self.hw_decoder_load)  # its check of hw_decoder_load, the one

    @property
    def global_batch(self) -> int:
        """Samples of one batch on every rank together: `batch_size * world_size`."""
        return self.batch_size * self.world_size

    @property
    def output(self) -> Output:
        """`fp16`, `channels_last` and `hw_decoder_load` as one record: how the graph hands out its images."""
        return Output(self.fp16, self.channels_last, self.hw_decoder_load)

    def resolved(self) -> LoaderOptions:
        """A copy with every None and `"auto"` decided on this node: `train` from the split's name, the ranks, `device`,
        `device_id`, `num_threads` and `prefetch_queue_depth` as their attributes say. Probes the GPU stack
        when `device` is `"auto"`."""
        ranks = resolve_ranks(self.rank, self.world_size, self.ranks_from)
        device = resolve_device(self.device)
        device_id = self.device_id
        if uses_gpu(device) and device_id is None:
            device_id = local_gpu(torch.cuda.current_device(), torch.cuda.device_count())
        return replace(self, train=trains(self.split, self.train), device=device, rank=ranks.rank,
                       world_size=ranks.world_size, ranks_from=ranks.source,
                       device_id=device_id if uses_gpu(device) else None,
                       num_threads=self.num_threads or thread_budget(device).threads,
                       prefetch_queue_depth=self.prefetch_queue_depth or defaults.prefetch_queue_depth(device))


# The epochs long enough for two lanes to pay (default_lanes): make bench's 30-batch epochs gain from them; the
# demo's training epochs (22 batches) keep one lane
LANES_MIN_BATCHES = 24


def default_lanes(options: LoaderOptions, batches: int) -> int:
    """Pipelines per rank (lanes.py) for epochs of `batches` batches: two for CPU training with two threads or
    more and epochs of LANES_MIN_BATCHES or more, else one. Two keep the cores busy where one pipeline leaves
    them partly idle: more lanes keep a costly policy's CPU work in parallel (docs/benchmarks.md, "Lanes, and
    one definition per loader"). That needed each epoch's pipelines made from the first, serialized, not defined
    again (defining one is costly CPU work, two per epoch), and the next epoch's lanes started before this one
    ends (a lane's first batch is a whole batch of one thread).
    One on the GPU (one decoder's memory and CUDA streams per rank), for validation (read once an epoch,
    plain) and with one thread."""
    two = options.device == "cpu" and options.train and options.num_threads >= 2 and batches >= LANES_MIN_BATCHES
    return 2 if two else 1


def ready(dataset: ShardData, options: LoaderOptions) -> LoaderOptions:
    """`options` resolved, after what every loader of `dataset` needs is checked, once: the split exists and
    holds samples, a training batch fits every rank (training drops partial batches), the split's files
    agree with their manifest (the dataset's `check`; each split once per dataset)."""
    dataset.require_split(options.split)
    options = options.resolved()
    if options.train:
        dataset.check_batch_fits(options.split, options.batch_size, options.world_size)
    dataset.check_files(options.split)
    return options


@dataclass
class Restore:
    """Where a loaded state puts the next iteration inside its epoch: DALI's checkpoint of this rank's reader
    (None: the epoch's remaining samples shared out anew, as on another number of ranks), the samples excluded
    from the epoch's pipeline (a resume on another number of ranks: those consumed before it; None: none) and
    those this rank had handed out from that pipeline (`SampleSet.to_state`; with the checkpoint only)."""

    dali: bytes | list[bytes] | None
    excluded: SampleSet | None = None
    seen: dict | None = None
    handed: list[int] | None = None  # whole batches each lane had handed out (several lanes: lanes.py)
    # whether each lane's reader was given only its own tars (False: a state of a dalifeed that gave every tar,
    # whose DALI checkpoints restore only into readers given every tar)
    own_tars: bool = True

    @classmethod
    def from_state(cls, state: dict) -> Restore:
        excluded = state.get("excluded")
        return cls(state["dali"], SampleSet.from_state(excluded) if excluded is not None else None,
                   state.get("seen"), state.get("handed"), state.get(OWN_TARS, False))

    def lane_checkpoints(self) -> list[bytes] | None:
        """Each lane's DALI checkpoint (a state of one lane holds it alone, as before lanes)."""
        return None if self.dali is None else list(self.dali) if isinstance(self.dali, list) else [self.dali]


class DaliLoader(FollowsCursor):
    """The loader of one shard folder's split: an iterable of torch batches that DALI reads and decodes.

    Get one from `make_loader` (classification) or `make_detection_loader`; its constructor takes the
    loader's internal parts. It keeps the epoch contract: validation yields every sample of the split once
    per epoch across all ranks, training exactly `len(loader)` full batches on every rank; an epoch's order
    depends on `(seed, epoch)` alone; each iteration reads the next epoch unless `set_epoch` or
    `load_state_dict` says otherwise; the next epoch's pipelines start before this one ends.

    Args:
        source: The shard folder, as `open_dataset` opened it (one of `ShardData.sources`).
        options: The loader's options, resolved and checked against the data.
        graph: The DALI graph every epoch runs; give this or `epoch_graph`. Default None.
        to_torch: Turns DALI's batch (a dict keyed by `outputs`) into what the iteration yields.
        outputs: The graph's output names. Default `("images", "labels")`.
        files: Where an epoch's tars are read from (local paths, store URLs or the shard cache's copies).
            Default: the manifest's locations.
        epoch_graph: epoch -> that epoch's graph (progressive resizing); give this or `graph`. Default None.

    Attributes:
        last_samples: The last batch's samples as `SHARD:POSITION` (the tar, and the sample's place in its
            index), when the loader tracks them (dali-train `--log-samples`); else empty.
    """

    def __init__(self, source: Source, options: LoaderOptions, *, graph: Graph | None = None,
                 to_torch: Callable[[dict], Any], outputs: tuple[str, ...] = CLASSIFICATION_OUTPUTS,
                 files: Files = epoch_files, epoch_graph: Callable[[int], Graph] | None = None):
        if (graph is None) == (epoch_graph is None):
            raise ValueError("DaliLoader takes one of graph= (every epoch's) and epoch_graph= (epoch -> its graph)")
        self.manifest, self.split = source.manifest, options.split
        self.to_torch, self.outputs = to_torch, outputs
        self.total_samples = self.manifest.num_samples(self.split)
        batches = self.total_samples // options.world_size // options.batch_size
        # lanes given (LoaderOptions.lanes) are kept; defaulted ones give way to a restored state's (load_state_dict)
        self._lanes_given = options.lanes is not None
        self.options = options if options.lanes else replace(options, lanes=default_lanes(options, batches))
        # A folder in a store: this loader's view of the node's shard cache (its pins are this loader's epoch)
        shard_cache = ShardCache(self.manifest, source.cache) if source.cache is not None else None
        self.plan = EpochPlan(self.manifest, self.options, files, shard_cache)
        # graph: the same every epoch; epoch_graph: one per epoch (progressive resizing binds each epoch's
        # image size), asked for the epoch being defined, also when it is defined ahead or restored
        self.definitions = EpochDefinitions(self.plan, self.options, epoch_graph or (lambda epoch: graph))
        self.cursor = EpochCursor(options.global_batch)
        self._iterator: LaneBatches | None = None  # the current epoch's, from its build to its end
        self._restore: Restore | None = None  # where the next iteration starts inside its epoch
        # Inside an epoch: the samples a resume on another number of ranks excluded from it (None: none), and
        # those this rank has handed out since its pipeline started (with `SAMPLE_SOURCES` in `outputs`)
        self._excluded: SampleSet | None = None
        self._seen = SampleSet()
        # what state_dict gives mid-epoch without a pipeline: where a consumer stopped, or a state not yet read
        self._paused: dict | None = None
        self.last_samples: list[str] = []  # the last batch's samples, `SHARD:POSITION` (when tracking them)
        self._next: tuple[int, LaneBatches, SampleKeys] | None = None  # the next epoch's pipelines, started
        if shard_cache is not None:  # the first epoch's tars coming while the caller gets ready
            shard_cache.prefetch(self.plan.epoch_shards(0), self.plan.shard_range(options.rank))
        self.definitions.define_ahead(self.cursor.epoch)  # the first epoch's graph, while the caller gets ready

    @property
    def tracks_samples(self) -> bool:
        """Whether this loader records the samples it hands out, which lets a mid-epoch state be resumed on
        another number of ranks."""
        return SAMPLE_SOURCES in self.outputs

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (training: only those in full batches)."""
        if self.options.train:
            return len(self) * self.options.batch_size
        start, end = self.plan.shard_range(self.options.rank)
        return end - start

    def __len__(self) -> int:
        """Batches this rank yields per epoch: training's full batches (the same on every rank), or
        validation's batches of this rank's part of the split, the last one possibly short."""
        o = self.options
        if o.train:
            return (self.total_samples // o.world_size) // o.batch_size
        return -(-self.num_samples // o.batch_size)

    # -- where it is -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this loader is, for a checkpoint: the epoch and the samples of it consumed by all ranks
        together and, between two batches of an epoch, DALI's reader state of this rank and the samples it
        has handed out (what a resume on another number of ranks joins).

        Returns:
            A dict of plain values, bytes and lists, for `torch.save`; `load_state_dict` takes it back.

        Raises:
            RuntimeError: Inside an epoch without `checkpointing=True`, or after the epoch's pipeline failed.
        """
        if self.cursor.samples_done == 0:  # between epochs, or none handed out yet
            return {"epoch": self.cursor.epoch, "samples_done": 0, "dali": None}
        if not self.options.checkpointing:
            raise RuntimeError("a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        if self._iterator is None:
            if self._paused is None:
                raise RuntimeError("this loader's epoch ended without a position to save (its pipeline failed): "
                                   "start the epoch again")
            return self._paused
        checkpoints = self._iterator.checkpoints()
        lanes = {} if len(checkpoints) == 1 else {"lanes": len(checkpoints), "handed": list(self._iterator.handed)}
        return {**self.cursor.state_dict(), "dali": checkpoints[0] if len(checkpoints) == 1 else checkpoints,
                **lanes, "world_size": self.options.world_size, OWN_TARS: True,
                "excluded": self._excluded.to_state() if self._excluded is not None else None,
                "seen": self._seen.to_state() if self.tracks_samples else None}

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration continue from a saved position.

        Args:
            state: `state_dict()` of a loader made with the same arguments (possibly in another process), or,
                to resume on another number of ranks, every rank's states merged (the epoch's remaining
                samples are then shared out anew).

        Raises:
            ValueError: A mid-epoch state without `checkpointing=True`, a reader state of another number of
                ranks not merged, or one saved with another number of lanes than `lanes=` gives.
        """
        refuse_foreign_state(state, self.options)
        self.cursor.load_state_dict(state)
        self._ahead = True
        self._paused = state if self.cursor.samples_done else None
        self._restore = Restore.from_state(state) if self.cursor.samples_done else None
        if self._restore is not None and state["dali"] is not None and self._lanes_given:
            excluded = self._restore.excluded.count() if self._restore.excluded is not None else 0
            refuse_other_lanes(len(self._restore.lane_checkpoints()), self.plan.epoch_lanes(self.total_samples
                                                                                            - excluded))

    def pipeline(self, checkpoint: bytes | None = None, epoch: int | None = None):
        """The DALI pipeline of an epoch, defined but not built (building a GPU graph needs the GPU), so that
        its graph can be inspected on a machine without one.

        Args:
            checkpoint: A DALI reader state to define it from; None: the epoch's start. Default None.
            epoch: The epoch; None: the current one. Default None.
        """
        return self.definitions.define(self.cursor.epoch if epoch is None else epoch, checkpoint, reuse=False)[0][0]

    # -- an epoch's pipelines ------------------------------------------------------------------------
    def _started(self, pipes: list, sizes: list[int], handed: list[int] | None, epoch: int) -> LaneBatches:
        """`pipes` (epoch `epoch`'s) built, their first runs scheduled, behind one `LaneBatches`."""
        self.definitions.remember(pipes[0], epoch)
        return start_lanes(pipes, sizes, handed, self.outputs, self.options)

    def _this_epoch(self, restore: Restore | None) -> tuple[LaneBatches, SampleKeys]:
        """The current epoch's pipelines, running: those `_start_next_epoch` started if they are this
        iteration's (else dropped), or built now (from a restored state's position)."""
        started, self._next = self._next, None
        if started is not None and restore is None and started[0] == self.cursor.epoch:
            return started[1], started[2]
        restored = (restore.lane_checkpoints(), restore.excluded, restore.own_tars) if restore is not None else None
        pipes, keys, sizes = self.definitions.defined(self.cursor.epoch, restored)
        handed = restore.handed if restore is not None and restore.dali is not None else None
        return self._started(pipes, sizes, handed, self.cursor.epoch), keys

    def _start_next_epoch(self) -> None:
        """Build the next epoch's pipelines and start their first runs now, where this epoch's have no run left
        to schedule: a fresh pipeline's first batch would otherwise be a pause at the epoch's start (module
        docstring). One that fails to start is started again, and fails with its own message, when it begins."""
        epoch = self.cursor.epoch + 1
        try:
            pipes, keys, sizes = self.definitions.defined(epoch)
            if not mappings_fit(self._iterator.pipes + pipes):  # built once this epoch's are freed, not beside them
                self.definitions.keep(epoch, (pipes, keys, sizes))
                return
            self._next = (epoch, self._started(pipes, sizes, None, epoch), keys)
        except Exception as e:
            if not is_pipeline_failure(e):
                raise
            self._next = None

    def _reads_next_epoch(self) -> bool:
        """Whether the epoch being read is followed by another this loader will read: not the run's last
        (`LoaderOptions.epochs`), nor a pass alone (`set_epoch(..., ahead=False)`). Only then is the next
        epoch defined, and in training started, before this one ends."""
        epochs = self.options.epochs
        return self._ahead and (epochs is None or self.cursor.epoch + 1 < epochs)

    def _release_pipeline(self) -> None:
        """Drop the epoch's pipeline now, not on a background thread where it would overlap the next build."""
        self._iterator = None

    def _batches_left(self) -> int:
        """Batches this rank still hands out in the epoch: training's full global batches of what the cursor
        has not consumed (the same count on every rank, and on any number of ranks sharing the global batch:
        elastic.batches_left), validation's `len`."""
        if not self.options.train:
            return len(self)
        return batches_left(self.total_samples, self.cursor.samples_done, self.cursor.global_batch)

    def __iter__(self):
        """One epoch's batches: the current epoch from its start, or from where a loaded state left it; the
        next iteration reads the next epoch."""
        cursor = self.cursor
        restore, self._restore = self._restore, None
        self._paused = None
        if restore is None:
            cursor.start(cursor.epoch)
        seen = self._seen = SampleSet() if restore is None or restore.dali is None else \
            SampleSet.from_state(restore.seen)
        self._excluded = restore.excluded if restore is not None else None
        try:
            self._release_pipeline()  # the pipeline of an epoch left unfinished
            left = self._batches_left()
            if left:  # (a state restored at an epoch's last batch has none left)
                self._iterator, keys = self._this_epoch(restore)
            else:
                self._next = None
            # when this epoch's pipelines have no run left to schedule, their threads fall idle: start the next
            start_next_at = len(self._iterator.pipes) * self.options.prefetch_queue_depth \
                if left and self.options.train and self.plan.shard_cache is None and self._reads_next_epoch() \
                else None
            # DALI decodes the rest of the rank's slice too, the batch dropped at the end included (so a sample
            # it cannot decode fails the epoch wherever it lands), but none of it is handed out
            next_defined = not self._reads_next_epoch()
            for outputs in self._iterator if left else ():
                if not next_defined:  # after the first batch, which would otherwise share the cores and the GIL
                    self.definitions.define_ahead(cursor.epoch + 1)
                    next_defined = True
                if left > 0:
                    left -= 1
                    if self.tracks_samples:
                        self.last_samples = keys.add(seen, host_sources(outputs.pop(SAMPLE_SOURCES)))
                    cursor.advance()
                    if start_next_at is not None and left <= start_next_at:
                        self._start_next_epoch()
                        start_next_at = None
                    yield self.to_torch(outputs)
        except GeneratorExit:
            # freed now, not beside validation's pipeline until the next epoch
            try:
                self._paused = self.state_dict() if self.options.checkpointing and cursor.samples_done else None
            finally:
                self._release_pipeline()
            raise
        except Exception as e:
            if not is_pipeline_failure(e):
                raise
            self._release_pipeline()  # a pipeline that failed is not reused
            raise explain_epoch_failure(e, self.plan, self.options, cursor.epoch, cursor.batches_done) from e
        # the epoch is over: free the pipeline (its threads, decoder state and buffers go back to DALI's
        # pools) so that the next loader to run, validation's or the next epoch's, does not sit beside it
        self._release_pipeline()
        self._excluded = None
        self.plan.end_rest()
        cursor.finish()

    def __del__(self):
        definitions = getattr(self, "definitions", None)
        if definitions is not None:
            definitions.close()


def start_lanes(pipes: list, sizes: list[int], handed: list[int] | None, outputs: tuple[str, ...],
                options: LoaderOptions) -> LaneBatches:
    """`pipes` (one epoch's, one per lane, reading `sizes` samples) built and their first runs scheduled, behind
    one `LaneBatches`; `handed`: the batches each lane had handed out (a restored state's)."""
    for pipe in pipes:
        pipe.build()
    # One lane drops its partial last batch in training; several hand theirs to LaneBatches to join
    policy = LastBatchPolicy.DROP if options.train and len(pipes) == 1 else LastBatchPolicy.PARTIAL
    # The lanes start together (DALI's iterator would run its pipeline's first batch when made: one lane after
    # the other)
    iterators = [EpochIterator([pipe], list(outputs), reader_name="Reader", last_batch_policy=policy,
                               last_batch_padded=False, auto_reset=False, prepare_first_batch=False)
                 for pipe in pipes]
    for iterator in iterators:
        iterator.start()
    return LaneBatches(iterators, sizes, options.batch_size, handed)


def refuse_foreign_state(state: dict, options: LoaderOptions) -> None:
    """A state with a DALI checkpoint is restored only by a checkpointing loader of as many ranks."""
    if state["dali"] is not None and not options.checkpointing:
        raise ValueError("restoring a mid-epoch loader state needs make_loader(..., checkpointing=True)")
    saved_world = state.get("world_size") or options.world_size
    if state["dali"] is not None and saved_world != options.world_size:
        raise ElasticError(f"a reader state of {saved_world} ranks cannot be restored on {options.world_size}: "
                           f"merge the ranks' states (elastic.merge_rank_states)")


def refuse_other_lanes(saved: int, lanes: int) -> None:
    """A state holds one DALI checkpoint per lane of its epoch, which then runs with as many: lanes given to the
    loader explicitly and different are refused (defaulted ones give way for that epoch)."""
    if saved != lanes:
        raise ValueError(f"a reader state of {saved} lane(s) cannot be restored with {lanes}: make the loader with "
                         f"lanes={saved} (LoaderOptions.lanes, dali-train --lanes), as the run that saved it, or "
                         f"leave lanes to the default")


def host_sources(sources: torch.Tensor):
    """The `SAMPLE_SOURCES` output as a numpy array. It is a CPU tensor whatever the device (a CPU node of the
    graph: tests/test_gpu_graphs.py checks it; DALI's PyTorch iterator gives each output the device of its
    node, plugin/pytorch/__init__.py `category_device`), so reading it never waits for the GPU."""
    return sources.numpy()


def images_and_labels(batch: dict, *, channels_last: bool, multilabel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The classification graph's batch -> `(images, labels)`: labels (B,) int64, or (B, K) multi-hot."""
    images = batch["images"]
    if channels_last:
        # DALI wrote NHWC; as a permuted view it is an NCHW tensor in channels_last memory format,
        # which is what a channels_last model consumes, with no copy.
        images = images.permute(0, 3, 1, 2)
    labels = batch["labels"]
    return images, labels if multilabel else labels.view(-1)


def classification_loader(source: Source, options: LoaderOptions, augment: AugmentConfig, multilabel: bool = False,
                          size_schedule: Callable[[int], int] | None = None) -> DaliLoader:
    """A `DaliLoader` of `(images, labels)` of one shard folder: images (B, 3, H, W) normalised, float32 or
    float16 and NCHW or channels_last (`options`' output), labels int64 (B,) (or float multi-hot
    (B, num_classes) with `multilabel`), both on the GPU for devices 'gpu' and 'hybrid', on the CPU for 'cpu'.
    `options` resolved and checked (`ready`). `size_schedule`: epoch -> the image size of that epoch
    (progressive resizing: `resolution.ProgressiveResize.size`) instead of `augment.image_size` in every
    epoch."""
    manifest = source.manifest
    classes = manifest.num_classes if multilabel else 0
    graph = partial(shard_pipeline, multilabel_classes=classes, text_label=manifest.dali_text_label,
                    out=options.output)
    to_torch = partial(images_and_labels, channels_last=options.channels_last, multilabel=multilabel)
    outputs = CLASSIFICATION_OUTPUTS
    if options.train and options.checkpointing:  # a mid-epoch state then says which samples were consumed
        graph, outputs = partial(graph, sources=True), (*outputs, SAMPLE_SOURCES)
    if size_schedule is None:
        return DaliLoader(source, options, graph=partial(graph, cfg=augment), to_torch=to_torch, outputs=outputs)
    return DaliLoader(source, options, to_torch=to_torch, outputs=outputs,
                      epoch_graph=lambda epoch: partial(graph, cfg=replace(augment, image_size=size_schedule(epoch))))
