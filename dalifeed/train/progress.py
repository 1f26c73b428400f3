"""What rank 0 shows as an epoch runs, between the epoch lines: `EpochProgress` (a bar, progress lines,
per-step TensorBoard scalars through the run's `RunLog`)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from .config import TrainConfig
from .distributed import Dist, log
from .run import EpochStats, RunLog, TrainState


class EpochProgress:
    """What rank 0 shows while an epoch runs, between the lines `Run.finish_epoch` prints: a tqdm bar where a
    person watches (stderr is a terminal); where stdout is not a terminal (Slurm, nohup, `> log`) a line every
    `cfg.progress_every` seconds; and every `cfg.tensorboard_every` optimizer steps, per-step TensorBoard
    scalars. The loss of the steps taken, and their number, are summed on the device and read only when one of
    these shows them, so they add no host sync to a step. That sum, in float64 and in step order, is also the
    epoch's `stats.loss` (written back by `snapshot` and `close`): a run resumed mid-epoch goes on from the
    checkpoint's sum and adds exactly what an uninterrupted run adds, however often its sum was read."""

    def __init__(self, cfg: TrainConfig, dist: Dist, state: TrainState, run_log: RunLog | None, steps: int,
                 stats: EpochStats):
        """For the epoch `state.epoch`, of `steps` optimizer steps; `stats` are those of its part already run
        (resuming mid-epoch), `state` is read as the steps go (its step count)."""
        self.cfg, self.dist, self.state, self.steps = cfg, dist, state, steps
        # (loss sum, steps) of the steps taken, on the device
        self.totals = torch.tensor([stats.loss, stats.steps - stats.bad_steps], dtype=torch.float64,
                                   device=dist.device)
        self.start, self.seconds_before, self.steps_before = time.perf_counter(), stats.seconds, stats.steps
        self.bar = tqdm(total=steps, initial=stats.steps, desc=f"epoch {state.epoch}", unit="step",
                        dynamic_ncols=True, leave=False, disable=not (dist.is_main and sys.stderr.isatty()))
        self.lines = dist.is_main and cfg.progress_every > 0 and not sys.stdout.isatty()
        self.next_line = self.start + cfg.progress_every
        tensorboard = dist.is_main and cfg.tensorboard_every and run_log and run_log.tb
        self.run_log = run_log if tensorboard else None
        # where the last TensorBoard point was: time, images, data wait, loss sum, steps taken
        self.mark = (self.start, stats.images, stats.data_wait, stats.loss, stats.steps - stats.bad_steps)

    def step_done(self, stats: EpochStats, loss_sum: torch.Tensor, skipped: torch.Tensor, lr: float) -> None:
        """After each optimizer step (`skipped`: 1.0 if it was not applied, on the device; `loss_sum`: its
        micro-steps' (loss sum, count)). Adding a skipped step's loss times 0 leaves the sum as it was."""
        taken = 1.0 - skipped.double()
        self.totals += torch.stack([(loss_sum[0] / loss_sum[1]).double() * taken, taken])
        self.bar.update(1)
        now = time.perf_counter()
        if not self.bar.disable and stats.steps % 10 == 0:
            self.bar.set_postfix(loss=f"{self.mean_loss():.3f}", lr=f"{lr:.3g}",
                                 img_s=f"{self.images_per_s(stats, now):.0f}")
        if self.lines and now >= self.next_line:
            self.next_line = now + self.cfg.progress_every
            log(self.line(stats, now))
        if self.run_log is not None and self.state.step % self.cfg.tensorboard_every == 0:
            self.write_scalars(stats, now, lr)

    def read(self) -> tuple[float, int]:
        """The loss sum and number of the steps taken so far: the one device read (a host sync)."""
        loss, taken = self.totals.tolist()
        return loss, int(taken)

    def mean_loss(self) -> float:
        loss, taken = self.read()
        return loss / max(1, taken)

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
                f"images/s, loss {self.mean_loss():.4g}, data wait {stats.data_wait / max(1e-9, elapsed):.0%}, "
                f"left: epoch {tqdm.format_interval(epoch_left)}, run {tqdm.format_interval(run_left)}")

    def write_scalars(self, stats: EpochStats, now: float, lr: float) -> None:
        """TensorBoard's step/ scalars, as means over the steps since the previous point."""
        start, images, data_wait, loss, taken = self.mark
        loss_now, taken_now = self.read()
        seconds = max(1e-9, now - start)
        scalars = {"step/lr": lr, "step/images_per_s": (stats.images - images) * self.dist.world_size / seconds,
                   "step/data_wait_share": (stats.data_wait - data_wait) / seconds}
        if taken_now > taken:
            scalars["step/train_loss"] = (loss_now - loss) / (taken_now - taken)
        self.run_log.write_step(self.state.step, scalars)
        self.mark = (now, stats.images, stats.data_wait, loss_now, taken_now)

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
