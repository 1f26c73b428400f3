"""A clean stop on SIGINT or SIGTERM: the signal is recorded, the ranks agree on it after a step, the run saves
a mid-epoch checkpoint and raises `TrainingStopped`."""

from __future__ import annotations

import signal
from contextlib import contextmanager

import torch

from dalifeed.runtime import Stopped

from .distributed import all_reduce_max


class TrainingStopped(Stopped):
    """SIGINT or SIGTERM stopped the run cleanly; `detail` says what last.pt holds and how to resume."""

    def __init__(self, signum: int, detail: str):
        super().__init__(signum)
        self.detail = detail


class Stop:
    """A stop request from SIGINT or SIGTERM, honoured between optimizer steps: the signal only records itself
    (`requested`), `agree` tells every rank after each optimizer step (`agreed`), and the loop saves a mid-epoch
    checkpoint and ends. A second Ctrl-C (SIGINT) stops at once; a repeated SIGTERM is the same request, not
    an order to hurry: under Slurm a rank gets one from Slurm (which signals every process of a job step) and
    one from torchrun (which forwards the one it got)."""

    def __init__(self) -> None:
        self.requested = 0  # signal number seen by this process
        self.agreed = 0  # signal number some rank had seen at the last `agree`, the same on every rank

    @contextmanager
    def listening(self):
        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise Stopped(signum)  # Ctrl-C again: no more waiting
            self.requested = self.requested or signum

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def agree(self, finite: torch.Tensor) -> bool:
        """Whether every rank's optimizer step is finite (`finite`: 1.0 or 0.0 on this rank's device), and so
        whether every rank steps; sets `agreed` to a stop any rank was asked for. One all-reduce answers both
        (the maximum of "not finite" and of the signal numbers), the host sync each optimizer step pays anyway
        to never apply a NaN update."""
        votes = torch.stack([1.0 - finite.reshape(()), torch.tensor(float(self.requested), device=finite.device)])
        not_finite, signum = all_reduce_max(votes).tolist()
        self.agreed = int(signum)
        return not_finite == 0.0
