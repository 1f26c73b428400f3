"""What dali-train shows while an epoch runs: progress lines in a log (stdout not a terminal), none on a
terminal, and per-step TensorBoard scalars. Real runs of the CLI on real shards, on the CPU."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.train.cli import main as train_cli
from dalifeed.train.run import RunLog
from fast_recipe import fast_args

FAST = fast_args(width=8)  # the training tests' recipe at width 8: 45 train images in 5 steps of 8
PROGRESS = re.compile(r"epoch (?P<epoch>\d+) step (?P<step>\d+)/(?P<steps>\d+): (?P<rate>\d+) images/s, "
                      r"loss (?P<loss>\S+), data wait (?P<wait>\d+)%, "
                      r"left: epoch (?P<left>[\d:]+), run (?P<run>[\d:]+)")


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=10)[1]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def seconds(interval: str) -> int:
    """tqdm's format_interval back to seconds: '01:05' -> 65, '1:00:05' -> 3605."""
    total = 0
    for part in interval.split(":"):
        total = total * 60 + int(part)
    return total


def test_a_log_gets_progress_lines_between_epoch_lines_and_tensorboard_per_step_scalars(shards, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    command = [sys.executable, "-m", "dalifeed.train.cli", "--data", str(shards), "--out", str(run), "--epochs", "2",
               *FAST, "--progress-every", "0.000001", "--tensorboard-every", "1"]  # a line and a point every step
    with open(log, "w") as stdout:  # what `> log`, nohup and Slurm give a job: stdout is a file
        proc = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = metrics(run)

    # in the log: steps 1..5 of epoch 0, epoch 0's line, steps 1..5 of epoch 1, epoch 1's line
    seen = []
    for line in log.read_text().splitlines():
        if match := PROGRESS.fullmatch(line):
            seen.append((int(match["epoch"]), int(match["step"]), match))
        elif line.startswith("epoch "):
            seen.append((int(line.split(",")[0].split()[1]), "end", None))
    assert [(e, s) for e, s, _ in seen] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, "end"),
                                            (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, "end")], log.read_text()
    lines = {(e, s): m for e, s, m in seen if m}
    for (_epoch, _step), m in lines.items():
        assert int(m["steps"]) == 5 and 0 <= int(m["wait"]) <= 100
        assert seconds(m["run"]) >= seconds(m["left"])
    # the running mean loss at an epoch's last step is the epoch's train_loss; the time left then is none
    for epoch in (0, 1):
        assert float(lines[epoch, 5]["loss"]) == pytest.approx(records[epoch]["train_loss"], rel=1e-3)
        assert seconds(lines[epoch, 5]["left"]) == 0
        # the rate over the epoch's 40 images when its last step is done: the epoch's, a moment before it ends
        assert int(lines[epoch, 5]["rate"]) >= int(records[epoch]["images_per_s"])
    assert seconds(lines[1, 5]["run"]) == 0 and seconds(lines[0, 1]["run"]) >= seconds(lines[0, 1]["left"])

    # TensorBoard: a point per optimizer step in tensorboard/steps; the epoch scalars stay apart
    steps = run / "tensorboard" / "steps"
    assert [s for s, _ in scalars(steps, "step/lr")] == list(range(1, 11))
    lr = dict(scalars(steps, "step/lr"))
    assert lr[5] == pytest.approx(records[0]["lr"]) and lr[10] == pytest.approx(records[1]["lr"], abs=1e-9)
    losses = dict(scalars(steps, "step/train_loss"))
    for epoch in (0, 1):  # each point is one step's loss: an epoch's five average to its train_loss
        mean = sum(losses[s] for s in range(5 * epoch + 1, 5 * epoch + 6)) / 5
        assert mean == pytest.approx(records[epoch]["train_loss"], rel=1e-4)
    rates = dict(scalars(steps, "step/images_per_s"))
    for epoch in (0, 1):  # 40 images (5 batches of 8) in the epoch's seconds, as metrics.jsonl records them
        assert records[epoch]["images_per_s"] * records[epoch]["epoch_seconds"] == pytest.approx(40)
        # a point's rate is its step's 8 images over the seconds since the point before: those add up to no
        # more than the epoch (a rate over the epoch so far would add up to about 3 epochs)
        step_seconds = [8 / rates[s] for s in range(5 * epoch + 1, 5 * epoch + 6)]
        assert sum(step_seconds) <= records[epoch]["epoch_seconds"] * (1 + 1e-9), (step_seconds, records[epoch])
    assert all(0 <= v <= 1 for _, v in scalars(steps, "step/data_wait_share"))
    assert [s for s, _ in scalars(run / "tensorboard", "top1")] == [0, 1]


def test_rates_are_images_over_the_seconds_given(tmp_path):
    """EpochProgress's numbers from given counts and clock readings (`now`), on two ranks: a progress line
    over the epoch so far, a TensorBoard point over the steps since the point before."""
    from dalifeed.train.config import TrainConfig
    from dalifeed.train.distributed import Dist
    from dalifeed.train.progress import EpochProgress
    from dalifeed.train.run import EpochStats, TrainState

    cfg = TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), epochs=1, tensorboard_every=1)
    state, run_log = TrainState(), RunLog(tmp_path / "run", enabled=True, resume_epoch=None)
    progress = EpochProgress(cfg, Dist(rank=0, world_size=2, local_rank=0, device=torch.device("cpu")), state,
                             run_log, steps=5, stats=EpochStats())
    start = progress.start

    # 2 steps of 8 images per rank in 2 s, 0.5 s of it waiting for data; then 1 step of 8 in the next 4 s
    state.step = 2
    progress.write_scalars(EpochStats(images=16, data_wait=0.5, steps=2), start + 2.0, lr=0.1)
    state.step = 3
    stats = EpochStats(images=24, data_wait=1.5, steps=3)
    progress.write_scalars(stats, start + 6.0, lr=0.1)
    run_log.steps_tb.close()
    steps = tmp_path / "run" / "tensorboard" / "steps"
    assert scalars(steps, "step/images_per_s") == [(2, 16 * 2 / 2.0), (3, 8 * 2 / 4.0)]
    assert scalars(steps, "step/data_wait_share") == [(2, 0.5 / 2.0), (3, 1.0 / 4.0)]

    # the line: 24 x 2 images in 6 s; 2 s a step, 2 steps left; the loss of the newest copy on the host
    assert "loss -," in progress.line(stats, start + 6.0)  # none copied yet
    progress.copies.request(progress.totals, state.step)
    assert progress.line(stats, start + 6.0) == ("epoch 0 step 3/5: 8 images/s, loss 0, data wait 25%, "
                                                 "left: epoch 00:04, run 00:04")


def test_no_progress_lines_on_a_terminal_or_when_turned_off(shards, tmp_path):
    off = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "off"), "--epochs", "1", *FAST,
                                         "--progress-every", "0", "--tensorboard-every", "0"])
    assert off.exit_code == 0, off.output
    assert not [line for line in off.stdout.splitlines() if PROGRESS.fullmatch(line)]
    assert not (tmp_path / "off" / "tensorboard" / "steps").exists()

    # stdout a terminal: the lines are for logs (a terminal with stderr on it gets tqdm's bar instead)
    controller, terminal = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal closed: the run ended
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "dalifeed.train.cli", "--data", str(shards), "--out",
                           str(tmp_path / "tty"), "--epochs", "1", *FAST, "--progress-every", "0.000001"],
                          stdout=terminal, stderr=subprocess.PIPE, timeout=300)
    os.close(terminal)
    reader.join(10)
    os.close(controller)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "epoch 0, lr" in shown  # the epoch line reached the terminal
    assert "images/s, loss" not in shown


def test_a_resumed_run_replaces_the_per_step_points_it_replays(tmp_path):
    """Killed at step 10 after a checkpoint at step 6: the resumed run writes steps 7.. again, and TensorBoard
    must show those, not the killed run's."""
    log = RunLog(tmp_path, enabled=True, resume_epoch=None)
    for step in range(1, 11):
        log.write_step(step, {"step/train_loss": 1.0})
    log.close()
    # TensorBoard reads a folder's event files in name order: the creation second, then a counter of the files
    # this process has made, which sorts 10 before 9; a resumed run starts in a later second
    time.sleep(1.01 - time.time() % 1)
    log = RunLog(tmp_path, enabled=True, resume_epoch=1, resume_step=6)
    for step in range(7, 13):
        log.write_step(step, {"step/train_loss": 2.0})
    log.close()
    assert scalars(tmp_path / "tensorboard" / "steps", "step/train_loss") == \
        [(s, 1.0) for s in range(1, 7)] + [(s, 2.0) for s in range(7, 13)]
