"""What the ranks agree on between optimizer steps, without making the host wait for the device at each step:
a stop on SIGINT or SIGTERM, and the steps skipped because a loss or gradient was not finite.

Each step's verdict (skip or not) is agreed on the device and acted on there (`trainer.optimizer_step`); the host
reads what happened at a check (`StepChecks.read`): after the first step of an epoch, then about every
`CHECK_SECONDS`, before every checkpoint and at the end of every epoch. A check is one all-reduce and one read,
the only host sync of the steps it covers, and it happens at the same step on every rank (the interval is
agreed in it too). So a stop signal is honoured within about CHECK_SECONDS (and one step) of arriving, on
every rank after the same step, and `--max-bad-steps` non-finite steps in a row stop the run at the next check,
before any checkpoint (the skipped steps never changed the weights)."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dalifeed.runtime import Stopped

from .distributed import all_reduce_max

# Seconds of training between two checks. A check drains the device's queue of work: the next step's kernels
# start only once the host has launched them, a gap of about one step's launch time (milliseconds for a
# ResNet-50 step) every CHECK_SECONDS, small beside the steps between. It is also how late a stop signal can be
# acted on: torchrun gives its workers 30 s after forwarding SIGTERM before it kills them, Slurm's KillWait
# is 30 s by default, and the mid-epoch checkpoint has to be written within that.
CHECK_SECONDS = 2.0
MAX_STEPS_BETWEEN_CHECKS = 1000  # however fast the steps: the step counts of a check stay small numbers


class TrainingStopped(Stopped):
    """SIGINT or SIGTERM stopped the run cleanly; `detail` says what last.pt holds and how to resume."""

    def __init__(self, signum: int, detail: str):
        super().__init__(signum)
        self.detail = detail


class Stop:
    """A stop request from SIGINT or SIGTERM, honoured between optimizer steps: the signal only records itself
    (`requested`), a check tells every rank (`agreed`, set by `StepChecks.read`), and the loop saves a mid-epoch
    checkpoint and ends. A second Ctrl-C (SIGINT) stops at once; a repeated SIGTERM is the same request, not
    an order to hurry: under Slurm a rank gets one from Slurm (which signals every process of a job step) and
    one from torchrun (which forwards the one it got)."""

    def __init__(self) -> None:
        self.requested = 0  # signal number seen by this process
        self.agreed = 0  # signal number some rank had seen at the last check, the same on every rank

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


def agree_to_skip(finite: torch.Tensor) -> torch.Tensor:
    """1.0 if some rank's optimizer step is not finite (`finite`: 1.0 or 0.0, on this rank's device), else 0.0:
    on the device, the same on every rank, unread. On NCCL the all-reduce is queued like a kernel and the host
    goes on."""
    return all_reduce_max(1.0 - finite)


@dataclass(frozen=True)
class Seen:
    """What a check read: optimizer steps since the previous check, how many of them were skipped, the run of
    skipped steps the last step ends (`streak`, 0 if it was taken) and the longest run since the previous check
    (`worst`, counting a run the previous check saw going on)."""

    steps: int
    skipped: int
    streak: int
    worst: int


class StepChecks:
    """The tallies of skipped steps, kept on the device between checks, and when the next check is. One per run;
    `start_epoch` at every epoch's start, `count` after every optimizer step, `read` when `due` (and wherever
    the loop needs to know: before a checkpoint, at an epoch's end)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.every = 1  # optimizer steps between checks: 1 until a check has timed some steps
        self.next = 0  # the step (TrainState.step) at which the next check is due
        self.start_epoch(streak=0, step=0)

    def start_epoch(self, streak: int, step: int) -> None:
        """Tallies from the host's: `streak` skipped steps in a row before this epoch (TrainState.bad_streak), at
        optimizer step `step`. Every epoch's first step is checked (it is the slow one: warm-up, cuDNN's
        search, a new pipeline), and the interval is timed from there."""
        # made on the device by a fill: torch.tensor(..., device=cuda) copies from pageable memory, a host sync
        self.skipped, self.streak, self.worst = (torch.full((), float(v), device=self.device)
                                                 for v in (0, streak, streak))
        self.next, self.last_step, self.last_time = step + 1, step, time.perf_counter()

    def count(self, skipped: torch.Tensor) -> None:
        """After an optimizer step that was skipped (`skipped` 1.0, on the device, the same on every rank) or
        not (0.0): device operations only."""
        self.skipped += skipped
        self.streak.add_(skipped).mul_(skipped)  # one longer if skipped, 0 if taken
        torch.maximum(self.worst, self.streak, out=self.worst)

    def due(self, step: int) -> bool:
        return step >= self.next

    def read(self, stop: Stop, step: int) -> Seen:
        """The check at optimizer step `step`: the tallies on the host, a stop any rank was asked for in
        `stop.agreed`, and the next check `every` steps on, the number of the slowest rank's steps that take
        CHECK_SECONDS. One all-reduce (the maximum of each value; the tallies are the same on every rank) and
        one read: the host sync."""
        seconds_per_step = (time.perf_counter() - self.last_time) / max(1, step - self.last_step)
        votes = torch.stack([self.skipped, self.streak, self.worst,
                             torch.full((), float(stop.requested), device=self.device),
                             torch.full((), seconds_per_step, device=self.device)])
        skipped, streak, worst, signum, slowest = all_reduce_max(votes).tolist()
        seen = Seen(step - self.last_step, int(skipped), int(streak), int(worst))
        stop.agreed = int(signum)
        self.every = max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(CHECK_SECONDS / max(slowest, 1e-9))))
        self.next, self.last_step, self.last_time = step + self.every, step, time.perf_counter()
        self.skipped.zero_()
        self.worst.copy_(self.streak)
        return seen
