"""`dali-train --synthetic`: the same trainer with data that costs nothing, to measure what loading costs."""

from __future__ import annotations


class SyntheticLoader:
    """Stands in for the training loader: one real batch of it, kept on the device, handed out `len(loader)`
    times an epoch. What the trainer reaches on it is the speed of model and optimiser alone (the
    ceiling); a run on the real loader at the same options shows how close the data path comes to it.
    Same interface as `DaliLoader` for what the trainer uses (epochs, mid-epoch state)."""

    def __init__(self, loader):
        self._loader, self._length = loader, len(loader)
        self._batch = None
        self.epoch, self._done, self._resume_at = 0, 0, 0

    def __len__(self) -> int:
        return self._length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self._done, "dali": None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._resume_at = state["epoch"], state["batches_done"]

    def _first_batch(self):
        images, labels = next(iter(self._loader))
        self._loader = None  # its pipeline (and the device memory it holds) is not needed again
        # DALI reuses its output buffers: keep copies, in the same memory format
        return images.clone(), labels.clone()

    def __iter__(self):
        if self._batch is None:
            self._batch = self._first_batch()
        self._done, self._resume_at = self._resume_at, 0
        while self._done < self._length:
            self._done += 1
            yield self._batch
        self.epoch += 1
