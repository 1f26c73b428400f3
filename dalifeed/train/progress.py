"""What rank 0 shows as an epoch runs, between the epoch lines: `EpochProgress` (a bar, progress lines,
per-step TensorBoard scalars through the run's `RunLog`), and `HostCopy`, how it reads the loss without waiting."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from .config import TrainConfig
from .distributed import Dist, log
from .run import EpochStats, RunLog, TrainState


class HostCopy:
    """A small device tensor's values on the host without waiting for the device: `request` queues a copy
    behind the work queued so far (pinned memory, non-blocking, an event after it), `latest` gives the newest
    copy whose event has passed, with the tag it was requested with (None before the first). On the CPU the
    copy is made at once. While one copy is in flight, a new request is dropped: shown values lag a step
    or a few on a GPU, and a step never waits for them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None  # pinned, made once: allocating it can wait for the device
        self._pending: tuple[object, torch.cuda.Event] | None = None
        self._latest: tuple[object, list[float]] | None = None

    def request(self, tensor: torch.Tensor, tag: object) -> None:
        if self.device.type != "cuda":
            self._latest = (tag, read_host_copy(tensor.detach().clone()))
            return
        self._collect()
        if self._pending is not None:
            return
        if self._host is None:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (tag, done)

    def latest(self) -> tuple[object, list[float]] | None:
        self._collect()
        return self._latest

    def _collect(self) -> None:
        if self._pending is not None and self._pending[1].query():
            self._latest, self._pending = (self._pending[0], read_host_copy(self._host)), None


def read_host_copy(host: torch.Tensor) -> list[float]:
    """A host tensor's values: a copy `HostCopy` made, complete (its event passed), so nothing waits."""
    return host.tolist()


class EpochProgress:
    """What rank 0 shows while an epoch runs, between the lines `Run.finish_epoch` prints: a tqdm bar where a
    person watches (stderr is a terminal); where stdout is not a terminal (Slurm, nohup, `> log`) a line every
    `cfg.progress_every` seconds; and every `cfg.tensorboard_every` optimizer steps, per-step TensorBoard
    scalars. The loss of the steps taken, and their number, are summed on the device and copied to the host
    without waiting when one of these shows them (`HostCopy`; on a GPU a shown loss is that of a few steps
    before), so they add no host sync to a step. That sum, in float64 and in step order, is also the
    epoch's `stats.loss` (written back by `snapshot` and `close`): a run resumed mid-epoch goes on from the
    checkpoint's sum and adds exactly what an uninterrupted run adds, however often its sum was read."""

    def __init__(self, cfg: TrainConfig, dist: Dist, state: TrainState, run_log: RunLog | None, steps: int,
                 stats: EpochStats):
        """For the epoch `state.epoch`, of `steps` optimizer steps; `stats` are those of its part already run
        (resuming mid-epoch), `state` is read as the steps go (its step count)."""
        self.cfg, self.dist, self.state, self.steps = cfg, dist, state, steps
        # (loss sum, steps) of the steps taken, on the device
        self.totals = torch.stack([torch.full((), float(v), dtype=torch.float64, device=dist.device)
                                   for v in (stats.loss, stats.steps - stats.bad_steps)])
        self.start, self.seconds_before, self.steps_before = time.perf_counter(), stats.seconds, stats.steps
        self.bar = tqdm(total=steps, initial=stats.steps, desc=f"epoch {state.epoch}", unit="step",
                        dynamic_ncols=True, leave=False, disable=not (dist.is_main and sys.stderr.isatty()))
        self.lines = dist.is_main and cfg.progress_every > 0 and not sys.stdout.isatty()
        self.next_line = self.start + cfg.progress_every
        tensorboard = dist.is_main and cfg.tensorboard_every and run_log and run_log.tb
        self.run_log = run_log if tensorboard else None
        self.copies = HostCopy(dist.device)
        # where the last TensorBoard point was: time, images, data wait; and its loss's: loss sum, steps taken
        self.mark = (self.start, stats.images, stats.data_wait)
        self.loss_mark = (stats.loss, stats.steps - stats.bad_steps)

    def step_done(self, stats: EpochStats, loss_sum: torch.Tensor, skipped: torch.Tensor, lr: float) -> None:
        """After each optimizer step (`skipped`: 1.0 if it was not applied, on the device; `loss_sum`: its
        micro-steps' (loss sum, count)). Adding a skipped step's loss times 0 leaves the sum as it was."""
        taken = 1.0 - skipped.double()
        self.totals += torch.stack([(loss_sum[0] / loss_sum[1]).double() * taken, taken])
        self.bar.update(1)
        now = time.perf_counter()
        bar = not self.bar.disable and stats.steps % 10 == 0
        line = self.lines and now >= self.next_line
        scalars = self.run_log is not None and self.state.step % self.cfg.tensorboard_every == 0
        if bar or line or scalars:
            self.copies.request(self.totals, self.state.step)
        if bar:
            self.bar.set_postfix(loss=self.shown_loss(".3f"), lr=f"{lr:.3g}",
                                 img_s=f"{self.images_per_s(stats, now):.0f}")
        if line:
            self.next_line = now + self.cfg.progress_every
            log(self.line(stats, now))
        if scalars:
            self.write_scalars(stats, now, lr)

    def read(self) -> tuple[float, int]:
        """The loss sum and number of the steps taken so far, waiting for the device (a host sync): for the
        checkpoints and the epoch's end only."""
        loss, taken = self.totals.tolist()
        return loss, int(taken)

    def shown_loss(self, spec: str) -> str:
        """The mean loss of the steps taken up to the newest copy on the host, formatted; "-" before one."""
        latest = self.copies.latest()
        if latest is None:
            return "-"
        loss, taken = latest[1]
        return format(loss / max(1, taken), spec)

    def images_per_s(self, stats: EpochStats, now: float) -> float:
        return stats.images * self.dist.world_size / max(1e-9, self.seconds_before + now - self.start)

    def line(self, stats: EpochStats, now: float) -> str:
        """`epoch 3 step 412/1251: 2519 images/s, loss 2.871, data wait 4%, left: epoch 05:31, run 7:42:10`;
        the rates over the epoch so far, the time left at this process's pace of steps (not counting
        evaluation)."""
        elapsed = self.seconds_before + now - self.start
        seconds_per_step = (now - self.start) / max(1, stats.steps - self.steps_before)
        epoch_left = (self.steps - stats.steps) * seconds_per_step
        run_left = epoch_left + (self.cfg.epochs - self.state.epoch - 1) * self.steps * seconds_per_step
        return (f"epoch {self.state.epoch} step {stats.steps}/{self.steps}: {self.images_per_s(stats, now):.0f} "
                f"images/s, loss {self.shown_loss('.4g')}, data wait {stats.data_wait / max(1e-9, elapsed):.0%}, "
                f"left: epoch {tqdm.format_interval(epoch_left)}, run {tqdm.format_interval(run_left)}")

    def write_scalars(self, stats: EpochStats, now: float, lr: float) -> None:
        """TensorBoard's step/ scalars, as means over the steps since the previous point; the loss's over the
        steps between the two newest copies on the host, at the step its copy was requested (on a GPU, a point
        or a few behind the others)."""
        start, images, data_wait = self.mark
        seconds = max(1e-9, now - start)
        self.run_log.write_step(self.state.step, {
            "step/lr": lr, "step/images_per_s": (stats.images - images) * self.dist.world_size / seconds,
            "step/data_wait_share": (stats.data_wait - data_wait) / seconds})
        self.mark = (now, stats.images, stats.data_wait)
        latest = self.copies.latest()
        if latest is None:
            return
        step, (loss_now, taken_now) = latest
        loss, taken = self.loss_mark
        if taken_now > taken:
            self.run_log.write_step(step, {"step/train_loss": (loss_now - loss) / (taken_now - taken)})
        self.loss_mark = (loss_now, taken_now)

    def elapsed(self) -> float:
        """Seconds of this epoch so far, counting those of the part a mid-epoch checkpoint ran."""
        return self.seconds_before + time.perf_counter() - self.start

    def snapshot(self, stats: EpochStats) -> EpochStats:
        """The epoch's statistics so far, as a mid-epoch checkpoint keeps them: the device's loss sum read."""
        return replace(stats, loss=self.read()[0], seconds=self.elapsed())

    def close(self, stats: EpochStats) -> None:
        """The epoch's end: `stats` get the loss sum and the time."""
        self.bar.close()
        stats.loss, stats.seconds = self.read()[0], self.elapsed()
