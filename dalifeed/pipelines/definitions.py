"""Each epoch's DALI pipelines, defined but not built: `EpochDefinitions`.

Defining a graph is Python, and slow with a policy; building and running it are not. So a loader defines its
graph once, for the first epoch: that pipeline is serialized before it is built, and every later epoch's is the
serialized definition with its own reader arguments (serialized.py), made on a background thread while the
epoch before runs. DALI keeps the definition state per thread (`pipeline_tls`, autograph's `ag_ctx.stacks`),
so definitions on that thread do not meet the caller's. A process forked meanwhile waits for a definition to
end (`DefinitionsAhead`)."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from .elastic import SampleKeys, SampleSet
from .plan import EpochPlan
from .serialized import NotEditable, SerializedPipeline, with_reader_arguments, without_origins

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
    the child, which then hangs at its first import of that module. `os.register_at_fork` runs `wait` in the
    forking thread first; a definition takes seconds at most, and after `WAIT_S` the fork goes ahead as it
    did."""

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

# (the pipelines of an epoch, one per lane; the SampleKeys that name their samples; the samples each lane reads)
Defined = tuple[list, SampleKeys, list[int]]


class EpochDefinitions:
    """The pipelines of each epoch of `plan` for `options` (resolved, lanes decided): `epoch_graph(epoch)`
    defined on the epoch's files, or made from its graph's first pipeline, serialized."""

    def __init__(self, plan: EpochPlan, options, epoch_graph: Callable[[int], Graph]):
        self.plan, self.options, self.epoch_graph = plan, options, epoch_graph
        # graph_key -> the first pipeline of that graph, serialized (None: one that cannot be reused)
        self._serialized: dict[tuple, bytes | None] = {}
        self._ahead: tuple[int, Future] | None = None  # (epoch, its pipelines being defined in the background)
        self._background: ThreadPoolExecutor | None = None

    def define(self, epoch: int, checkpoint: bytes | list[bytes] | None = None, excluded: SampleSet | None = None,
               own_tars: bool = True, reuse: bool = True) -> Defined:
        """Epoch `epoch`'s pipelines; with `excluded`, over the epoch's samples not in it (a resume on another
        number of ranks: elastic.py); `checkpoint`, each lane's DALI checkpoint (a list), or lane 0's alone;
        `own_tars` False: each lane's reader given every tar (a state saved when lanes were given them). With
        `reuse`, made from the first pipeline of the same graph, serialized, where there is one (serialized.py),
        instead of defining the graph again."""
        plan = self.plan
        shards = plan.epoch_shards(epoch)
        full_index = {s.path: str(plan.manifest.root / s.index) for s in shards}
        remaining = None
        if excluded is not None:
            shards, remaining = plan.remaining(shards, excluded)
        tars, indexes = plan.epoch_files(shards, epoch)
        keys = SampleKeys(tars, shards, [full_index[s.path] for s in shards])
        total = sum(s.samples for s in shards)
        # a restored state's checkpoints, one per lane of the epoch it was taken in, say how many lanes it has
        lanes = len(checkpoint) if isinstance(checkpoint, list) else plan.epoch_lanes(total)
        checkpoints = checkpoint if isinstance(checkpoint, list) else [checkpoint] + [None] * (lanes - 1)
        resumed_at = excluded.count() if excluded is not None else 0
        graph = self.epoch_graph(epoch)
        serialized = self._serialized.get(graph_key(graph)) if reuse else None
        indexes = indexes if remaining is None else remaining
        counts = [s.samples for s in shards]
        # the lanes' cut indexes, removed with the last of these pipelines (DALI reads them when one is built)
        cuts = tempfile.TemporaryDirectory(prefix="dalifeed-lanes-")
        pipes = [self._lane_pipeline(graph, serialized, tars, indexes,
                                     plan.lane_files(tars, indexes, counts, lanes, lane, Path(cuts.name))
                                     if own_tars else None,
                                     lane=lane, lanes=lanes, seed=plan.pipeline_seed(epoch, resumed_at, lane),
                                     checkpoint=checkpoints[lane])
                 for lane in range(lanes)]
        for pipe in pipes:
            pipe.dalifeed_cuts = cuts
        return pipes, keys, plan.lane_sizes(total, lanes)

    def _lane_pipeline(self, graph: Graph, serialized: bytes | None, tars: list[str], indexes: list[str],
                       own: tuple[list[str], list[str]] | None, *, lane: int, lanes: int, seed: int,
                       checkpoint: bytes | None):
        """Lane `lane`'s pipeline (of `lanes`): `graph` defined, or `serialized` (the same graph's, serialized)
        with this reader's arguments. It reads the files `own` (`EpochPlan.lane_files`) whole, or, where that
        is None, its shard of `tars`."""
        o = self.options
        if own is not None:
            (tars, indexes), reader = own, dict(shard_id=0, num_shards=1)
        else:
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
            pipe = SerializedPipeline(with_reader_arguments(serialized, paths=tars, index_paths=indexes, **reader),
                                      **params)
        else:
            pipe = graph(tars, indexes, train=o.train, device=o.device, initial_fill=o.initial_fill, **reader, **params)
        pipe.dalifeed_tars = len(tars)  # the file mappings its reader reserves when built (`mappings_fit`)
        return pipe

    def remember(self, pipe, epoch: int) -> None:
        """Serialize the first pipeline of epoch `epoch`'s graph, which later epochs are made from (`define`),
        before it is built. Here, not where it is defined: serializing creates DALI's backend pipeline, which for
        a GPU graph needs CUDA (a defined graph does not: tests/test_gpu_graphs.py)."""
        key = graph_key(self.epoch_graph(epoch))
        if key is None or key in self._serialized or isinstance(pipe, SerializedPipeline):
            return
        try:
            self._serialized[key] = without_origins(pipe.serialize())
            # one webdataset reader, with every argument `_lane_pipeline` replaces
            with_reader_arguments(self._serialized[key], paths=[], index_paths=[], shard_id=0, num_shards=1)
        except NotEditable:
            self._serialized[key] = None  # defined again every epoch, as before

    def define_ahead(self, epoch: int) -> None:
        """Start defining epoch `epoch`'s pipelines on the background thread, so that the epoch does not wait
        for it. Not with a shard cache: its `epoch_files` fetches and pins the epoch's tars, which waits for
        the epoch's start."""
        if self.plan.shard_cache is not None:
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="dalifeed-loader")
        self._ahead = (epoch, self._background.submit(DEFINITIONS_AHEAD.run, self.define, epoch))

    @property
    def ahead(self) -> int | None:
        """The epoch being defined in the background, or None."""
        return self._ahead[0] if self._ahead is not None else None

    def defined(self, epoch: int, restored: tuple[list[bytes] | None, SampleSet | None, bool] | None = None) \
            -> Defined:
        """Epoch `epoch`'s `define`: the one defined ahead if it is this epoch's and nothing is `restored` (lane
        checkpoints, samples excluded, own tars) (a definition that failed raises here, as it would have defined now),
        else defined now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and restored is None and ahead[0] == epoch:
            return ahead[1].result()
        return self.define(epoch) if restored is None else self.define(epoch, *restored)

    def keep(self, epoch: int, defined: Defined) -> None:
        """Epoch `epoch`'s pipelines, defined and not built, are what `defined` gives for it next."""
        done: Future = Future()
        done.set_result(defined)
        self._ahead = (epoch, done)

    def close(self) -> None:
        """Let a definition under way finish: one left running would outlive the loader, and a process forked
        meanwhile (a DataLoader's workers) would copy it half done."""
        if self._background is not None:
            try:
                self._background.shutdown(wait=True, cancel_futures=True)
            except Exception:  # interpreter shutdown
                pass
