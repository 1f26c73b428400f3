"""DALI's PyTorch iterator over one epoch of a pipeline that is dropped when the epoch ends.

DALI's iterator keeps `prefetch_queue_depth` runs scheduled ahead of the batch it hands out, epoch after epoch:
at an epoch's end the pipeline is already preparing the next epoch's first batches (the reader wraps around),
ready for `reset()`. The loader never resets: it builds a pipeline per epoch (each epoch's shard order is given
to the reader when the pipeline is built) and drops it when the epoch ends. Those runs were thrown away, and
dropping the pipeline waited for them: 2 runs on the CPU (with a policy, most of the pause before the next
epoch's first batch), 5 with GPU decoding. `EpochIterator` schedules no run past the
epoch's last: the runs that read the epoch, the partial batch dropped at its end included, are all scheduled as
before, and the pipeline is idle when the last one is handed out.

It overrides two of DALI 2.4's iterator methods (`_schedule_runs`, `_get_outputs`) and reads four of its
fields: `_size` and `_counter` (the samples the iterator hands out in the epoch, and those it has),
`_ever_scheduled`, and the pipeline's `_batches_to_consume` (runs scheduled and not yet fetched). A DALI without
those fields gets DALI's own scheduling (only the speed-up is lost). If a later DALI counts differently, a run it
wants and that was not scheduled is scheduled when it is fetched (one batch time late, never a shortened
epoch), and one scheduled that it does not want is waited for as before (tests/test_loader.py runs both).
"""

from __future__ import annotations

import math

from nvidia.dali import types
from nvidia.dali.plugin.pytorch import DALIGenericIterator


class EpochIterator(DALIGenericIterator):
    """DALIGenericIterator that does not run its pipeline past the end of the epoch (see the module docstring)."""

    def _runs_to_fetch_after_this_one(self) -> int:
        # called between fetching a batch and counting it: `_counter` does not include it yet
        return max(0, math.ceil((self._size - self._counter) / self.batch_size) - 1)

    def _bounded(self) -> bool:
        """DALI's fields are there and the epoch's length is known."""
        return getattr(self, "_size", -1) > 0 and hasattr(self, "_counter") and hasattr(self, "_ever_scheduled") \
            and all(hasattr(p, "_batches_to_consume") for p in self._pipes)

    def start(self) -> None:
        """Schedule the pipeline's first runs now (made with `prepare_first_batch=False`, DALI's iterator waits
        for the first `next`)."""
        if not self._ever_scheduled:
            self._schedule_runs(False)

    def _schedule_runs(self, release_outputs: bool = True) -> None:
        if not self._bounded() or not self._ever_scheduled:
            super()._schedule_runs(release_outputs)  # the first runs (prefetch), or DALI's own scheduling
            return
        wanted = self._runs_to_fetch_after_this_one()
        for p in self._pipes:
            with p._check_api_type_scope(types.PipelineAPIType.ITERATOR):
                if release_outputs:
                    p.release_outputs()
                if p._batches_to_consume < wanted:
                    p.schedule_run()

    def _get_outputs(self):
        if self._bounded() and self._ever_scheduled and self._counter < self._size:
            for p in self._pipes:  # a run wanted that was not scheduled (see the module docstring)
                if p._batches_to_consume == 0:
                    with p._check_api_type_scope(types.PipelineAPIType.ITERATOR):
                        p.schedule_run()
        return super()._get_outputs()
