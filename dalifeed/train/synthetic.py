"""`dali-train --synthetic`: the same trainer with data that costs nothing, to measure what loading costs."""

from __future__ import annotations

from dalifeed.pipelines.cursor import EpochCursor


class SyntheticLoader:
    """Stands in for the training loader: one real batch of it, kept on the device, handed out `len(loader)`
    times an epoch. What the trainer reaches on it is the speed of model and optimiser alone (the
    ceiling); a run on the real loader at the same options shows how close the data path comes to it.
    Counts its place as every loader does (`EpochCursor`: epoch, samples consumed by all ranks)."""

    def __init__(self, loader):
        self._loader, self._length = loader, len(loader)
        self._batch = None
        self.cursor = EpochCursor(loader.cursor.global_batch)
        self._resuming = False

    def __len__(self) -> int:
        return self._length

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        self.cursor.start(epoch)
        self._resuming = False

    def state_dict(self) -> dict:
        return {**self.cursor.state_dict(), "dali": None}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)
        self._resuming = True

    def _first_batch(self):
        images, labels = next(iter(self._loader))
        self._loader = None  # its pipeline (and the device memory it holds) is not needed again
        # DALI reuses its output buffers: keep copies, in the same memory format
        return images.clone(), labels.clone()

    def __iter__(self):
        if self._batch is None:
            self._batch = self._first_batch()
        if not self._resuming:
            self.cursor.start(self.cursor.epoch)
        self._resuming = False
        while self.cursor.batches_done < self._length:
            self.cursor.advance()
            yield self._batch
        self.cursor.finish()
