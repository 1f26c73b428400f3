"""One epoch cursor for every training loader (`DaliLoader`, `MixedLoader`, dali-train's `SyntheticLoader`):
where a loader is in its data, counted the same way everywhere and saved the same way.

Its position is global: the samples of the epoch consumed by all ranks together. Training loaders hand out
the same number of batches on every rank, so one batch on each of W ranks moves it by `batch_size * W`; a
resume reads the position without knowing how the ranks that saved it shared the work, which is what an
elastic resume (another number of ranks) needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochCursor:
    """The epoch being read (or the next one, between epochs) and the samples of it consumed by all ranks
    together. `global_batch`: what one batch on every rank consumes."""

    global_batch: int
    epoch: int = 0
    samples_done: int = 0

    @property
    def batches_done(self) -> int:
        """Batches handed out by each rank in this epoch."""
        return self.samples_done // self.global_batch

    def start(self, epoch: int) -> None:
        """The next iteration reads epoch `epoch` from its start."""
        self.epoch, self.samples_done = epoch, 0

    def advance(self) -> None:
        """One batch handed out on every rank."""
        self.samples_done += self.global_batch

    def finish(self) -> None:
        """The epoch is over: the cursor points at the start of the next."""
        self.epoch, self.samples_done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_done": self.samples_done}

    def load_state_dict(self, state: dict) -> None:
        """From `state_dict()` (a checkpoint written before the count was global said `batches_done` per rank,
        the same on every rank)."""
        self.epoch = state["epoch"]
        self.samples_done = state["samples_done"] if "samples_done" in state \
            else state["batches_done"] * self.global_batch


class FollowsCursor:
    """What every training loader built on an `EpochCursor` answers the same way: its epoch, and a jump to
    another epoch. A loader sets `cursor`, keeps in `_restore` what a loaded state hands its next iteration
    (None: the iteration starts its epoch afresh), and writes its own `state_dict` / `load_state_dict`
    around `cursor.state_dict()`."""

    cursor: EpochCursor
    _restore = None
    _ahead = True  # whether an epoch may start the next one's pipelines before it ends (`set_epoch`)

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def set_epoch(self, epoch: int, *, ahead: bool = True) -> None:
        """Make the next iteration yield an epoch from its start (a loaded state is dropped).

        Args:
            epoch: The epoch, counted from 0; its order depends on `(seed, epoch)` alone.
            ahead: True: a training loader starts the next epoch's pipelines over this epoch's last batches,
                so that it begins without a pause (never past `epochs`, the run's end). False: a pass over
                this epoch alone (a BatchNorm or evaluation pass over training data), starting nothing of a
                next epoch until the next `set_epoch`. Default True.
        """
        self.cursor.start(epoch)
        self._restore = None
        self._ahead = ahead
