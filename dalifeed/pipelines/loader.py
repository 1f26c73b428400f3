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
- Elastic resume (another number of ranks, the same global batch): a checkpointing training loader records
  the samples it hands out (`SAMPLE_SOURCES`), its state holds them, and the state `elastic.merge_rank_states`
  makes of every rank's, loaded by each new rank, reads the epoch's samples not yet consumed through index
  files listing only them (elastic.py): every sample of the epoch once, floor(N / global batch) batches in
  all.
- One pipeline per epoch: each epoch reads through its own DALI pipeline, built for its `(seed, epoch)` order
  and freed when the epoch ends. A training loader builds the next epoch's pipelines and starts their first
  runs near the end of each epoch, once this epoch's have no run left to schedule, so that the next epoch's
  first batch is ready when it begins; the next iteration reads them if it is that epoch from its start (else
  they are dropped). So a rank holds two training pipelines over an epoch's last `prefetch_queue_depth`
  batches, and the next epoch's (idle, its first batches made) beside validation's (docs/gpu.md, "Memory per
  rank"). Not with a shard cache, whose tars are pinned when their epoch starts. Defining a graph is Python
  and slow with a policy, so it is done once: the first epoch's pipeline is serialized before it is built,
  and every later epoch's is that definition with its own reader arguments (serialized.py), made on a
  background thread while the epoch before runs; a process forked meanwhile waits for a definition to end
  (`DefinitionsAhead`).
- Lanes (`LoaderOptions.lanes`, lanes.py): CPU training reads the rank's shard in two pipelines of half the
  threads, whole batches from each in turn; the contract above holds the same (a mid-epoch state holds each
  lane's checkpoint and is restored with as many lanes).
- Progressive resizing (`classification_loader(..., image_size=)`): the graph of epoch e is built for the
  image size of epoch e (a function of the epoch alone: resolution.py), so the epoch defined ahead, one set
  by `set_epoch` and one restored mid-epoch all train at the size an uninterrupted run would have.

Which splits train: `train=None` (the default of `make_loader` and `make_detection_loader`) means a split
whose name starts with "train" trains (`train`, COCO's `train2017`, `training`, `trainval`) and any other
is read as validation (`val`, `val2017`, `test`, `mini`); `train=True` or `False` says it outright
(`trains`).

How it is put together (the shape of DALI's examples: a graph function plus an iterator): one `DaliLoader`
holds the epoch contract above for one shard folder (a `dataset.Source`: its manifest and where its tars
are read from) and is given the DALI graph to run (`graphs.shard_pipeline` for classification,
`detection.detection_pipeline` for detection), the names of its outputs, and the function that turns DALI's
batch into what torch code takes (`images_and_labels`, `detection.targets_from_batch`); what it reads and
how (split, batch, rank, seed, device, threads, ...) is a `LoaderOptions`, checked against the dataset once
by `ready`; where it is in the data is its `cursor.EpochCursor` (the epoch and the samples of it consumed by
all ranks), with the live iterator and a checkpoint to restore beside it. Which files an epoch reads is
`epoch_files` (the tar a path or s3:// URL, the index a local path), passed in as `files`. The factories
that build loaders from a dataset and options are in factory.py.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from nvidia.dali.plugin.pytorch import LastBatchPolicy

from dalifeed import defaults
from dalifeed.budget import thread_budget
from dalifeed.decode import DaliDecoder
from dalifeed.format import ShardInfo, ShardManifest, trains
from dalifeed.pipelines.shardcache import ShardCache
from dalifeed.stack import StackReport, choose_device, stack_report

from .checks import SampleRef, explain_dali_error, indexed_samples, is_pipeline_failure
from .cursor import EpochCursor, FollowsCursor
from .dataset import Dataset, Source
from .elastic import ElasticError, SampleKeys, SampleSet, batches_left, remaining_index
from .epoch_iterator import EpochIterator
from .graphs import AugmentConfig, shard_pipeline, uses_gpu
from .lanes import LaneBatches, lane_sizes
from .names import DEVICES
from .serialized import NotEditable, SerializedPipeline, with_reader_arguments, without_origins

CLASSIFICATION_OUTPUTS = ("images", "labels")
# The graph output naming each sample where it was read (`graphs.sample_sources`), taken off the batch before
# `to_torch`: a checkpointing training loader records with it which samples it has handed out (elastic.py).
SAMPLE_SOURCES = "sources"


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
    """What a loader reads (`split`) and how, whatever its graph: a run's loader config, printed and saved
    with it. Left None, `train` follows the split's name (`format.trains`), `device_id` is the current CUDA
    device on a GPU, `num_threads` this rank's share of the CPUs (`budget.thread_budget`),
    `prefetch_queue_depth` the device's default (defaults.py: NVIDIA's published 5 with `mixed` decoding,
    DALI's 2 otherwise); `device` 'auto' is decided by `resolve_device`. `resolved()` fills them in, which is
    what a `DaliLoader` runs with. `lanes`, the pipelines that share this rank's epoch and its threads
    (lanes.py), the loader decides from the epoch's length when None (`default_lanes`)."""

    split: str
    batch_size: int
    train: bool | None = None
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    device: str = "auto"
    device_id: int | None = None
    num_threads: int | None = None
    prefetch_queue_depth: int | None = None
    initial_fill: int = 1024
    checkpointing: bool = False
    lanes: int | None = None

    def __post_init__(self) -> None:
        if self.lanes is not None and self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def resolved(self) -> LoaderOptions:
        """Every None and 'auto' decided on this node (see the class docstring)."""
        device = resolve_device(self.device)
        device_id = self.device_id
        if uses_gpu(device) and device_id is None:
            device_id = torch.cuda.current_device()
        return replace(self, train=trains(self.split, self.train), device=device,
                       device_id=device_id if uses_gpu(device) else None,
                       num_threads=self.num_threads or thread_budget(device).threads,
                       prefetch_queue_depth=self.prefetch_queue_depth or defaults.prefetch_queue_depth(device))


# The epochs long enough for two lanes to pay (default_lanes): make bench's 30-batch epochs gain 14-33%; the
# demo's training epochs (22 batches) keep one lane
LANES_MIN_BATCHES = 24


def default_lanes(options: LoaderOptions, batches: int) -> int:
    """Pipelines per rank (lanes.py) for epochs of `batches` batches: two for CPU training with two threads or
    more and epochs of LANES_MIN_BATCHES or more, else one. Two keep 2 cores busy where one pipeline leaves
    them 10-15% idle: on make bench's 30-batch epochs with erasing, ta_wide 651 -> 813 images/s, ra 540 ->
    722, imagenet 743 -> 850, and 920, 791, 864 with the next epoch's lanes started ahead
    (docs/benchmarks.md, "One definition per loader"). That needed each epoch's
    pipelines made from the first, serialized, not defined again (0.3-0.5 CPU s each, two per epoch), and
    the next epoch's lanes started before this one ends (a lane's first batch is a whole batch of one thread).
    One on the GPU (one decoder's memory and CUDA streams per rank), for validation (read once an epoch,
    plain) and with one thread."""
    two = options.device == "cpu" and options.train and options.num_threads >= 2 and batches >= LANES_MIN_BATCHES
    return 2 if two else 1


def ready(dataset: Dataset, options: LoaderOptions) -> LoaderOptions:
    """`options` resolved, after what every loader of `dataset` needs is checked, once: the split exists and
    holds samples, a training batch fits every rank (training drops partial batches), the split's files
    agree with their manifest (the dataset's `check`; each split once per dataset)."""
    dataset.require_split(options.split)
    options = options.resolved()
    if options.train:
        dataset.check_batch_fits(options.split, options.batch_size, options.world_size)
    dataset.check_files(options.split)
    return options


def epoch_files(manifest: ShardManifest, shards: list[ShardInfo]) -> tuple[list[str], list[str]]:
    """Where DALI reads `shards` from, in order: the tars (paths, or s3:// URLs: DALI reads those from the
    store) and their indexes (local paths: a store's indexes are in the cache, `check_files` fetched them)."""
    return [manifest.shard_location(s) for s in shards], [str(manifest.root / s.index) for s in shards]


# graph(tars, indexes, *, train, device, **pipeline arguments) -> a DALI pipeline, defined, not built
Graph = Callable[..., Any]


def graph_key(graph: Graph) -> tuple | None:
    """What makes two epochs' graphs the same graph: the function and the arguments bound to it (progressive
    resizing binds each epoch's image size anew: one key per size), or None where those cannot be compared."""
    key = (graph.func, graph.args, _frozen(graph.keywords)) if isinstance(graph, partial) else (graph,)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


class DefinitionsAhead:
    """The pipelines loaders are defining on their background threads, which a fork waits for.

    A process forked while another thread defines a graph (a DataLoader's workers; shard-convert's come from a
    fork server instead) copies the locks that thread holds, a module's import lock among them, held forever in
    the child: the child hung at its first import of that module (found with two lanes, whose definitions take
    twice as long, in tests that fork right after a loader's epoch). `os.register_at_fork` runs `wait` in the forking
    thread first; a definition takes seconds at most, and after `WAIT_S` the fork goes ahead as it did."""

    WAIT_S = 60.0

    def __init__(self):
        self._running = 0
        self._idle = threading.Condition()

    def run(self, define: Callable[..., Any], *args) -> Any:
        with self._idle:
            self._running += 1
        try:
            return define(*args)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def wait(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout=self.WAIT_S)


DEFINITIONS_AHEAD = DefinitionsAhead()
os.register_at_fork(before=DEFINITIONS_AHEAD.wait)


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

    def lane_checkpoints(self) -> list[bytes] | None:
        """Each lane's DALI checkpoint (a state of one lane holds it alone, as before lanes)."""
        return None if self.dali is None else list(self.dali) if isinstance(self.dali, list) else [self.dali]


class DaliLoader(FollowsCursor):
    """An iterable of torch batches of `options.split` of the shard folder `source`: `graph` (see `Graph`), or
    for each epoch `epoch_graph(epoch)`, run by DALI's PyTorch iterator, whose batch (a dict by `outputs`)
    `to_torch` converts. `options` are resolved and checked (`ready`). See the module docstring for epochs;
    `files` says where an epoch's shards are read from, the source's shard cache (a folder in a store) where
    it has one."""

    def __init__(self, source: Source, options: LoaderOptions, *, graph: Graph | None = None,
                 to_torch: Callable[[dict], Any], outputs: tuple[str, ...] = CLASSIFICATION_OUTPUTS,
                 files: Callable[[ShardManifest, list[ShardInfo]], tuple[list[str], list[str]]] = epoch_files,
                 epoch_graph: Callable[[int], Graph] | None = None):
        if (graph is None) == (epoch_graph is None):
            raise ValueError("DaliLoader takes one of graph= (every epoch's) and epoch_graph= (epoch -> its graph)")
        self.manifest, self.split = source.manifest, options.split
        # graph: the same every epoch; epoch_graph: one per epoch (progressive resizing binds each epoch's
        # image size), asked for the epoch being defined, also when it is defined ahead or restored
        self.epoch_graph = epoch_graph or (lambda epoch: graph)
        self.to_torch, self.outputs, self.files = to_torch, outputs, files
        self._shards = self.manifest.split_info(self.split).shards
        self.total_samples = self.manifest.num_samples(self.split)
        batches = self.total_samples // options.world_size // options.batch_size
        # lanes given (LoaderOptions.lanes) are kept; defaulted ones give way to a restored state's (load_state_dict)
        self._lanes_given = options.lanes is not None
        self.options = options if options.lanes else replace(options, lanes=default_lanes(options, batches))
        self.cursor = EpochCursor(options.global_batch)
        self._iterator: LaneBatches | None = None  # the current epoch's, from its build to its end
        self._restore: Restore | None = None  # where the next iteration starts inside its epoch
        # Inside an epoch: the samples a resume on another number of ranks excluded from it (None: none), and
        # those this rank has handed out since its pipeline started (with `SAMPLE_SOURCES` in `outputs`)
        self._excluded: SampleSet | None = None
        self._seen = SampleSet()
        self._rest: tempfile.TemporaryDirectory | None = None  # index files of a resumed epoch's remaining samples
        # what state_dict gives mid-epoch without a pipeline: where a consumer stopped, or a state not yet read
        self._paused: dict | None = None
        self.last_samples: list[str] = []  # the last batch's samples, `SHARD:POSITION` (when tracking them)
        self._ahead: tuple[int, Future] | None = None  # (epoch, its pipeline being defined in the background)
        self._next: tuple[int, LaneBatches, SampleKeys] | None = None  # the next epoch's lanes, started
        self._background: ThreadPoolExecutor | None = None  # defines pipelines ahead
        # graph_key -> the first pipeline of that graph, serialized (None: one that cannot be reused)
        self._serialized: dict[tuple, bytes | None] = {}
        # A folder in a store: this loader's view of the node's shard cache (its pins are this loader's
        # epoch), the first epoch's tars coming while the caller gets ready.
        self.shard_cache = ShardCache(self.manifest, source.cache) if source.cache is not None else None
        if self.shard_cache is not None:
            self.shard_cache.prefetch(self._epoch_shards(), self._shard_range(options.rank))
        self._define_ahead(self.cursor.epoch)  # the first epoch's graph, while the caller gets ready

    # -- sizes -------------------------------------------------------------------------------------
    def _shard_range(self, shard_id: int, total: int | None = None) -> tuple[int, int]:
        # DALI's split of N samples (default: the split's) into `world_size` contiguous shards
        n, w = self.total_samples if total is None else total, self.options.world_size
        return n * shard_id // w, n * (shard_id + 1) // w

    @property
    def tracks_samples(self) -> bool:
        """Whether this loader records the samples it hands out: what lets a mid-epoch state be resumed on
        another number of ranks (`elastic.merge_rank_states`)."""
        return SAMPLE_SOURCES in self.outputs

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
    def state_dict(self) -> dict:
        """Where this loader is: the cursor (epoch, samples consumed by all ranks) and, between two batches of
        an epoch, DALI's checkpoint of this rank after the last of them (only with `checkpointing=True`), the
        number of ranks, the samples a resume excluded from the epoch and those this rank has handed out
        since (what `elastic.merge_rank_states` joins when another number of ranks resumes)."""
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
                **lanes, "world_size": self.options.world_size,
                "excluded": self._excluded.to_state() if self._excluded is not None else None,
                "seen": self._seen.to_state() if self.tracks_samples else None}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration continues from `state`: from `state_dict()` of a loader with the same arguments
        (possibly in another process), or, on another number of ranks, what `elastic.merge_rank_states` made of
        every rank's (no DALI checkpoint: the epoch's remaining samples are shared out anew)."""
        if state["dali"] is not None and not self.options.checkpointing:
            raise ValueError("restoring a mid-epoch loader state needs make_loader(..., checkpointing=True)")
        saved_world = state.get("world_size") or self.options.world_size
        if state["dali"] is not None and saved_world != self.options.world_size:
            raise ElasticError(f"a reader state of {saved_world} ranks cannot be restored on "
                               f"{self.options.world_size}: merge the ranks' states (elastic.merge_rank_states)")
        self.cursor.load_state_dict(state)
        self._paused = state if self.cursor.samples_done else None
        excluded = state.get("excluded")
        self._restore = None if self.cursor.samples_done == 0 else \
            Restore(state["dali"], SampleSet.from_state(excluded) if excluded is not None else None, state.get("seen"),
                    state.get("handed"))
        if self._restore is not None and state["dali"] is not None:
            self._refuse_other_lanes(len(self._restore.lane_checkpoints()), self._restore.excluded)

    def _refuse_other_lanes(self, saved: int, excluded: SampleSet | None) -> None:
        """A reader state holds one DALI checkpoint per lane of the epoch it was taken in: restored, the epoch
        runs with as many (`_define` takes them from the checkpoints). Lanes the loader was given explicitly
        and that differ are refused; defaulted ones give way for that epoch (a resume with other
        `--dali-threads`, or on a machine of other cores, would otherwise default to another number), and
        the epochs after it take the default again."""
        if not self._lanes_given:
            return
        lanes = self._epoch_lanes(self.total_samples - (excluded.count() if excluded is not None else 0))
        if saved != lanes:
            raise ValueError(f"a reader state of {saved} lane(s) cannot be restored with {lanes}: make the loader "
                             f"with lanes={saved} (LoaderOptions.lanes, dali-train --lanes), as the run that saved "
                             f"it, or leave lanes to the default")

    def _epoch_shards(self, epoch: int | None = None) -> list[ShardInfo]:
        if not self.options.train:
            return list(self._shards)
        order = list(range(len(self._shards)))
        epoch = self.cursor.epoch if epoch is None else epoch
        random.Random(f"{self.options.seed}:{epoch}").shuffle(order)  # same on every rank: a partition
        return [self._shards[i] for i in order]

    def _epoch_files(self, shards: list[ShardInfo], epoch: int | None = None) -> tuple[list[str], list[str]]:
        """`files` of this epoch's shards; from a store with a shard cache, the local copies of this rank's
        tars, fetched whole first (and the next epoch's started in the background: dalifeed/pipelines/shardcache.py)."""
        if self.shard_cache is None:
            return self.files(self.manifest, shards)
        epoch = self.cursor.epoch if epoch is None else epoch
        rank_range = self._shard_range(self.options.rank, sum(s.samples for s in shards))
        tars = self.shard_cache.epoch_files(shards, rank_range, upcoming=self._epoch_shards(epoch + 1))
        return tars, [str(self.manifest.root / s.index) for s in shards]

    def _remaining(self, shards: list[ShardInfo], excluded: SampleSet) -> tuple[list[ShardInfo], list[str]]:
        """The epoch's shards with samples not in `excluded` (each counting only those) and index files listing
        only them, written to a folder this loader holds until the epoch ends."""
        if self._rest is None:
            self._rest = tempfile.TemporaryDirectory(prefix="dalifeed-rest-")
        kept, indexes = [], []
        for shard in shards:
            out = Path(self._rest.name) / f"{len(kept)}-{Path(shard.index).name}"
            samples = remaining_index(self.manifest.root / shard.index, excluded.of(shard.path), out)
            if samples:  # a shard read whole is left out: DALI refuses an index of no samples
                kept.append(replace(shard, samples=samples))
                indexes.append(str(out))
        return kept, indexes

    def _pipeline_seed(self, epoch: int, resumed_at: int = 0, lane: int = 0) -> int:
        # distinct per rank and lane (different augmentations) and per epoch, and for the rest of an epoch shared
        # out anew after `resumed_at` samples (the same again when that rest is itself restored); below 2**31 as
        # DALI requires
        rest = f":{resumed_at}" if resumed_at else ""
        lane_of = f"/{lane}" if lane else ""
        return random.Random(f"{self.options.seed}:{epoch}:{self.options.rank}{lane_of}{rest}").randrange(2**31)

    def _epoch_lanes(self, total: int) -> int:
        """Lanes of an epoch whose pipelines read `total` samples: `options.lanes`, unless a lane would hold
        less than a batch (then one: a small split, or little of an epoch left)."""
        o = self.options
        return o.lanes if min(lane_sizes(total, o.rank, o.world_size, o.lanes)) >= o.batch_size else 1

    def pipeline(self, checkpoint: bytes | None = None, epoch: int | None = None):
        """The DALI pipeline of epoch `epoch` (default: the current one), defined but not built (building is
        what needs the GPU: tests/test_gpu_graphs.py checks the GPU graphs on a machine without one through
        this)."""
        return self._define(self.cursor.epoch if epoch is None else epoch, checkpoint, reuse=False)[0][0]

    def _define(self, epoch: int, checkpoint: bytes | list[bytes] | None = None, excluded: SampleSet | None = None,
                reuse: bool = True):
        """(the pipelines of epoch `epoch`, one per lane, the `SampleKeys` that name their samples, the samples
        each lane reads); with `excluded`, over the epoch's samples not in it (a resume on another number of
        ranks: elastic.py); `checkpoint`, each lane's DALI checkpoint (a list), or lane 0's alone.
        With `reuse`, made from the first pipeline of the same graph, serialized, where there is one
        (serialized.py), instead of defining the graph again."""
        shards = self._epoch_shards(epoch)
        full_index = {s.path: str(self.manifest.root / s.index) for s in shards}
        remaining = None
        if excluded is not None:
            shards, remaining = self._remaining(shards, excluded)
        tars, indexes = self._epoch_files(shards, epoch)
        keys = SampleKeys(tars, shards, [full_index[s.path] for s in shards])
        total = sum(s.samples for s in shards)
        # a restored state's checkpoints, one per lane of the epoch it was taken in, say how many lanes it has
        lanes = len(checkpoint) if isinstance(checkpoint, list) else self._epoch_lanes(total)
        checkpoints = checkpoint if isinstance(checkpoint, list) else [checkpoint] + [None] * (lanes - 1)
        resumed_at = excluded.count() if excluded is not None else 0
        graph = self.epoch_graph(epoch)
        serialized = self._serialized.get(graph_key(graph)) if reuse else None
        pipes = [self._lane_pipeline(graph, serialized, tars, indexes if remaining is None else remaining,
                                     lane=lane, lanes=lanes, seed=self._pipeline_seed(epoch, resumed_at, lane),
                                     checkpoint=checkpoints[lane])
                 for lane in range(lanes)]
        return pipes, keys, lane_sizes(total, self.options.rank, self.options.world_size, lanes)

    def _lane_pipeline(self, graph: Graph, serialized: bytes | None, tars: list[str], indexes: list[str], *,
                       lane: int, lanes: int, seed: int, checkpoint: bytes | None):
        """Lane `lane`'s pipeline (of `lanes`) over `tars`: `graph` defined, or `serialized` (the same graph's,
        serialized) with this reader's arguments."""
        o = self.options
        reader = dict(shard_id=o.rank * lanes + lane, num_shards=o.world_size * lanes)
        params = dict(
            batch_size=o.batch_size, num_threads=max(1, o.num_threads // lanes), device_id=o.device_id, seed=seed,
            prefetch_queue_depth=o.prefetch_queue_depth, enable_checkpointing=o.checkpointing, checkpoint=checkpoint,
            # Said, not assumed: DALI 2.4's iterator hands out its buffers without a copy only under the
            # dynamic executor (plugin/pytorch: `copy = not pipe.exec_dynamic`), and the detection graph reads
            # `.shape()` of GPU nodes on the CPU, which only it allows. It is DALI's default only while
            # exec_async and exec_pipelined are on and the prefetch queues are not split (pipeline.py).
            exec_dynamic=True)
        if serialized is not None:
            return SerializedPipeline(with_reader_arguments(serialized, paths=tars, index_paths=indexes, **reader),
                                      **params)
        return graph(tars, indexes, train=o.train, device=o.device, initial_fill=o.initial_fill, **reader, **params)

    def _remember_graph(self, pipe, epoch: int) -> None:
        """Serialize the first pipeline of epoch `epoch`'s graph, which later epochs are made from
        (`_define`), before it is built. Here, not where it is defined: serializing creates DALI's backend
        pipeline, which for a GPU graph needs CUDA (a defined graph does not: tests/test_gpu_graphs.py)."""
        key = graph_key(self.epoch_graph(epoch))
        if key is None or key in self._serialized or isinstance(pipe, SerializedPipeline):
            return
        try:
            self._serialized[key] = without_origins(pipe.serialize())
            # one webdataset reader, with every argument `_lane_pipeline` replaces
            with_reader_arguments(self._serialized[key], paths=[], index_paths=[], shard_id=0, num_shards=1)
        except NotEditable:
            self._serialized[key] = None  # defined again every epoch, as before

    def _define_ahead(self, epoch: int) -> None:
        """Start defining epoch `epoch`'s pipeline on a background thread, so that the epoch does not wait for
        it: defining a graph is Python (docs/gpu.md, "A pipeline per epoch"; once the first epoch's is
        serialized, only its reader arguments are replaced), building and running it are not, and DALI keeps
        the definition state per thread (`pipeline_tls`, autograph's `ag_ctx.stacks`). Only the definition:
        building allocates the pipeline's threads and device memory (`_start_next_epoch`). Not with a shard
        cache: its `epoch_files` fetches and pins the epoch's tars, which waits for the epoch's start."""
        if self.shard_cache is not None:
            return
        self._ahead = (epoch, self._background_thread().submit(DEFINITIONS_AHEAD.run, self._define, epoch))

    def _release_pipeline(self) -> None:
        """Drop the pipeline of the epoch that ended (or was left), here and now. At an epoch's end it has no
        run left to wait for (EpochIterator schedules none past the epoch); one left mid-epoch waits for the
        batches it was preparing. Released on a background thread, it overlapped the next pipeline's build
        (validation's or the next epoch's), two pipelines' threads at once, which tests/test_budget.py refuses."""
        self._iterator = None

    def _background_thread(self) -> ThreadPoolExecutor:
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="dalifeed-loader")
        return self._background

    def __del__(self):
        # a definition still under way would outlive the loader, and a process forked meanwhile (a
        # DataLoader's workers) would copy it half done: let it finish first
        background = getattr(self, "_background", None)
        if background is not None:
            try:
                background.shutdown(wait=True, cancel_futures=True)
            except Exception:  # interpreter shutdown
                pass

    def _defined(self, restore: Restore | None, epoch: int | None = None):
        """Epoch `epoch`'s (default: the current one) `_define`: the one defined ahead if it is this epoch's and
        nothing is restored (a definition that failed raises here, as it would have defined now), else defined
        now."""
        epoch = self.cursor.epoch if epoch is None else epoch
        ahead, self._ahead = self._ahead, None
        if ahead is not None and restore is None and ahead[0] == epoch:
            return ahead[1].result()
        if restore is None:
            return self._define(epoch)
        return self._define(epoch, restore.lane_checkpoints(), restore.excluded)

    def _build_iterator(self, restore: Restore | None) -> tuple[LaneBatches, SampleKeys]:
        pipes, keys, sizes = self._defined(restore)
        handed = restore.handed if restore is not None and restore.dali is not None else None
        return self._started(pipes, sizes, handed, self.cursor.epoch), keys

    def _started(self, pipes: list, sizes: list[int], handed: list[int] | None, epoch: int) -> LaneBatches:
        """`pipes` (epoch `epoch`'s) built, their first runs scheduled, behind one `LaneBatches`."""
        self._remember_graph(pipes[0], epoch)
        for pipe in pipes:
            pipe.build()
        # One lane drops its partial last batch in training; several hand theirs to LaneBatches to join
        policy = LastBatchPolicy.DROP if self.options.train and len(pipes) == 1 else LastBatchPolicy.PARTIAL
        # The lanes start together (DALI's iterator would run its pipeline's first batch when made: one lane
        # after the other)
        iterators = [EpochIterator([pipe], list(self.outputs), reader_name="Reader", last_batch_policy=policy,
                                   last_batch_padded=False, auto_reset=False, prepare_first_batch=False)
                     for pipe in pipes]
        for iterator in iterators:
            iterator.start()
        return LaneBatches(iterators, sizes, self.options.batch_size, handed)

    def _start_next_epoch(self) -> None:
        """Build the next epoch's pipelines and start their first runs now, near the end of this epoch, where
        this epoch's have no run left to schedule: a fresh pipeline's first batch (its shuffle buffer filled,
        its executor started, a whole batch computed) would otherwise be a pause at the epoch's start. A rank
        then holds the next epoch's pipelines beside this epoch's last batches and, idle once their first
        batches are made, through validation (module docstring). A next epoch that fails to start is started
        again, and fails with its own message, when it begins."""
        epoch = self.cursor.epoch + 1
        try:
            pipes, keys, sizes = self._defined(None, epoch)
            self._next = (epoch, self._started(pipes, sizes, None, epoch), keys)
        except Exception as e:
            if not is_pipeline_failure(e):
                raise
            self._next = None

    def _next_started(self, restore: Restore | None) -> tuple[LaneBatches, SampleKeys] | None:
        """The lanes `_start_next_epoch` started, if they are this iteration's (dropped if not)."""
        started, self._next = self._next, None
        if started is not None and restore is None and started[0] == self.cursor.epoch:
            return started[1], started[2]
        return None

    def _batches_left(self) -> int:
        """Batches this rank still hands out in the epoch: training's full global batches of what the cursor
        has not consumed (the same count on every rank, and on any number of ranks sharing the global batch:
        elastic.batches_left), validation's `len`."""
        if not self.options.train:
            return len(self)
        return batches_left(self.total_samples, self.cursor.samples_done, self.cursor.global_batch)

    def __iter__(self):
        cursor = self.cursor
        restore, self._restore = self._restore, None
        self._paused = None
        if restore is None:
            cursor.start(cursor.epoch)
        seen = self._seen = SampleSet() if restore is None or restore.dali is None else \
            SampleSet.from_state(restore.seen)
        self._excluded = restore.excluded if restore is not None else None
        try:
            # A pipeline per epoch: training's order is a function of (seed, epoch) that the reader is given
            # at build time, and between epochs no pipeline is held but the next epoch's lanes
            # (`_start_next_epoch`; see the module docstring).
            self._release_pipeline()  # the pipeline of an epoch left unfinished
            started = self._next_started(restore)
            left = self._batches_left()
            if left:  # (a state restored at an epoch's last batch has none left)
                # running the first batches already (started near the end of the epoch before, in lanes)
                self._iterator, keys = started or self._build_iterator(restore)
            del started
            # when this epoch's pipelines have no run left to schedule, their threads fall idle: start the next
            start_next_at = len(self._iterator.pipes) * self.options.prefetch_queue_depth \
                if left and self.options.train and self.shard_cache is None else None
            # DALI decodes the rest of the rank's slice too, the batch dropped at the end included (so a sample
            # it cannot decode fails the epoch wherever it lands), but none of it is handed out
            next_defined = False
            for outputs in self._iterator if left else ():
                if not next_defined:  # the next epoch's, while this one runs; after its first batch, which
                    # would otherwise share the cores and the GIL with a definition (+250 ms with two lanes)
                    self._define_ahead(cursor.epoch + 1)
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
            raise self._explain(e) from e
        # the epoch is over: free the pipeline (its threads, decoder state and buffers go back to DALI's
        # pools) so that the next loader to run, validation's or the next epoch's, does not sit beside it
        self._release_pipeline()
        self._end_rest()
        cursor.finish()

    def _end_rest(self) -> None:
        """The epoch resumed on other ranks is over: its remaining-sample index files go."""
        self._excluded = None
        if self._rest is not None:
            self._rest.cleanup()
            self._rest = None

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
        read = (self.cursor.batches_done + o.prefetch_queue_depth + 3) * o.batch_size + o.initial_fill
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


def classification_loader(source: Source, options: LoaderOptions, augment: AugmentConfig,
                          multilabel: bool = False, image_size: Callable[[int], int] | None = None) -> DaliLoader:
    """A `DaliLoader` of `(images, labels)` of one shard folder: images float (B, 3, H, W) or (B, H, W, 3)
    normalised, labels int64 (B,) (or float multi-hot (B, num_classes) with `multilabel`), both on the GPU
    for devices 'gpu' and 'hybrid', on the CPU for 'cpu'. `options` resolved and checked (`ready`).
    `image_size`: epoch -> the image size of that epoch (progressive resizing: `resolution.ProgressiveResize.size`)
    instead of `augment.image_size` in every epoch."""
    manifest = source.manifest
    classes = manifest.num_classes if multilabel else 0
    graph = partial(shard_pipeline, multilabel_classes=classes, text_label=manifest.dali_text_label)
    to_torch = partial(images_and_labels, channels_last=augment.channels_last, multilabel=multilabel)
    outputs = CLASSIFICATION_OUTPUTS
    if options.train and options.checkpointing:  # a mid-epoch state then says which samples were consumed
        graph, outputs = partial(graph, sources=True), (*outputs, SAMPLE_SOURCES)
    if image_size is None:
        return DaliLoader(source, options, graph=partial(graph, cfg=augment), to_torch=to_torch, outputs=outputs)
    return DaliLoader(source, options, to_torch=to_torch, outputs=outputs,
                      epoch_graph=lambda epoch: partial(graph, cfg=replace(augment, image_size=image_size(epoch))))
