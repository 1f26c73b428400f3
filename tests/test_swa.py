"""dali-train --swa-start: the weights averaged after every epoch from that one on, BatchNorm recomputed over the
training data through the DALI loader, swa_* metrics and RUN/swa.pt; a SIGTERM in the SWA phase and a resume
give the same average, bit for bit, as a run never stopped."""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.train import checkpoint
from dalifeed.train.cli import main as train_cli
from dalifeed.train.distributed import Dist
from dalifeed.train.stop import StepChecks
from dalifeed.train.swa import swa_schedule, update_bn
from dalifeed.train.trainer import warmup_cosine
from fast_recipe import fast_args


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """3 colour-coded classes: 45 train images (5 steps of 8 an epoch), 21 val."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    return shards


def swa_args(shards: Path, out: Path, *more: str) -> list[str]:
    return ["--data", str(shards), "--out", str(out), *fast_args(epochs=4, width=16), "--swa-start", "1",
            "--swa-lr", "0.01", "--swa-anneal-epochs", "1", *more]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_swa_averages_the_epochs_evaluates_and_saves_swa_pt(shards, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, swa_args(shards, run, "--ema", "0.9"))
    assert result.exit_code == 0, result.output
    records = metrics(run)
    assert [("swa_top1" in r) for r in records] == [False, False, False, True]
    last = records[-1]
    assert {"swa_top1", "swa_top5", "swa_val_loss", "ema_top1"} <= set(last) and 0 <= last["swa_top1"] <= 1
    assert "swa_top1" in result.output and "SWA: the average of 3 epochs (1 to 3)" in result.output
    assert [r["lr"] for r in records][1:] == pytest.approx([0.01 * 8 / 256] * 3)  # constant after the anneal
    saved = checkpoint.load(run / "swa.pt")
    assert saved["swa"] == {"start": 1, "epochs_averaged": 3} and saved["classes"] == ["blue", "green", "red"]
    weights = saved["model"]
    assert any(torch.count_nonzero(w != 0) for k, w in weights.items() if "running_mean" in k)
    model_weights = checkpoint.load(run / "last.pt")["model"]
    differs = [k for k in weights if weights[k].is_floating_point() and not torch.equal(weights[k], model_weights[k])]
    assert differs  # an average of three epochs, not the last one's weights
    again = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "ft"), "--pretrained",
                                           str(run / "swa.pt"), *fast_args(epochs=1, width=16)])
    assert again.exit_code == 0, again.output  # swa.pt is a checkpoint --pretrained reads


def test_a_sigterm_in_the_swa_phase_resumes_to_the_same_swa_pt_and_last_pt(shards, tmp_path, monkeypatch):
    """With --device cpu, whose "cpu" read back from the saved config is another string object than torch's
    storage location: the checkpoints' bytes are still those of the run never stopped."""
    run = tmp_path / "run"  # the same folder both times: the checkpoints' config names it
    assert CliRunner().invoke(train_cli, swa_args(shards, run, "--device", "cpu")).exit_code == 0
    straight = tmp_path / "straight"
    run.rename(straight)

    real_count, steps = StepChecks.count, []

    def count_then_sigterm(self, skipped):
        real_count(self, skipped)
        steps.append(1)
        if len(steps) == 12:  # epoch 2, step 2: inside the SWA phase, one average taken
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(StepChecks, "count", count_then_sigterm)
        stopped = CliRunner().invoke(train_cli, swa_args(shards, run, "--device", "cpu"))
    assert stopped.exit_code == 143, stopped.output
    saved = checkpoint.load(run / "last.pt")
    # stopped at the next check: inside epoch 2 (one average taken) or at its end (two)
    assert saved["state"]["epoch"] in (2, 3) and int(saved["swa"]["n_averaged"]) == saved["state"]["epoch"] - 1
    assert not (run / "swa.pt").exists()
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    for name in ("swa.pt", "last.pt"):
        assert (straight / name).read_bytes() == (run / name).read_bytes(), name  # the file, bit for bit
    assert metrics(run)[-1]["swa_top1"] == metrics(straight)[-1]["swa_top1"]


def test_a_run_that_fails_before_its_last_checkpoint_writes_swa_pt_on_resume(shards, tmp_path):
    """swa.pt is written before the last epoch's last.pt: a failure between them (here swa.pt cannot be
    written) leaves last.pt at the epoch before, and the resume replays the last epoch and writes it. With
    --val-split none, best.pt keeps the lowest train loss from the first epoch on, even one above 1."""
    run = tmp_path / "run"
    (run / "swa.pt").mkdir(parents=True)
    args = ["--data", str(shards), "--out", str(run), *fast_args(epochs=2, width=16), "--swa-start", "1",
            "--val-split", "none"]
    failed = CliRunner().invoke(train_cli, args)
    assert failed.exit_code == 1 and checkpoint.load(run / "last.pt")["state"]["epoch"] == 1
    assert checkpoint.load(run / "best.pt")["metrics"]["epoch"] == 0
    (run / "swa.pt").rmdir()
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert checkpoint.load(run / "swa.pt")["swa"]["epochs_averaged"] == 1


class PassLoader(list):
    """Batches `update_bn` reads as a training loader's one pass (`set_epoch(e, ahead=False)`)."""

    def set_epoch(self, epoch, ahead=True):
        self.epoch, self.ahead = epoch, ahead


def test_update_bn_is_torchs_update_bn():
    """Over the same batches, in one process without autocast: the statistics torch's update_bn gives, bit for
    bit (each batch weighed by the same Python float 1/(k+1) torch computes from its count); the loader is
    pointed at the epoch for one pass alone (nothing of a next epoch started: tests/test_loader_epochs.py)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4))
    batches = [(torch.randn(5, 3, 8, 8) * (i + 1), torch.zeros(5)) for i in range(4)]
    ours, torchs = copy.deepcopy(model), copy.deepcopy(model)
    loader = PassLoader(batches)
    read = update_bn(ours, loader, Dist(0, 1, 0, torch.device("cpu")), None, channels_last=False, epoch=7)
    torch.optim.swa_utils.update_bn(batches, torchs)
    assert read == 4 and loader.epoch == 7 and loader.ahead is False
    assert all(torch.equal(a, b) for a, b in zip(ours.buffers(), torchs.buffers(), strict=True))
    assert all(m.momentum == 0.1 for m in ours.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_update_bn_counts_each_call_of_a_batchnorm_as_torch_does():
    """A BatchNorm applied twice a batch (a shared layer), one without running statistics and one whose
    momentum is None: torch counts every call of a layer (`num_batches_tracked`), so its cumulative weights are
    1/1, 1/2, ... per call, not per batch; the same buffers bit for bit, and each layer's momentum back."""
    torch.manual_seed(0)
    shared = torch.nn.BatchNorm2d(3, momentum=None)
    model = torch.nn.Sequential(shared, torch.nn.Conv2d(3, 3, 3), shared, torch.nn.BatchNorm2d(3, affine=False),
                                torch.nn.BatchNorm2d(3, track_running_stats=False))
    batches = [(torch.randn(5, 3, 9, 9) * (i + 1) + i, torch.zeros(5)) for i in range(3)]
    ours, torchs = copy.deepcopy(model), copy.deepcopy(model)
    assert update_bn(ours, PassLoader(batches), Dist(0, 1, 0, torch.device("cpu")), None, False, epoch=0) == 3
    torch.optim.swa_utils.update_bn(batches, torchs)
    assert int(ours[0].num_batches_tracked) == 6
    assert all(torch.equal(a, b) for a, b in zip(ours.buffers(), torchs.buffers(), strict=True))
    assert [ours[0].momentum, ours[3].momentum, ours[4].momentum] == [None, 0.1, 0.1]


def test_update_bn_over_ranks_skips_a_batchnorm_without_running_statistics():
    """The ranks' average is of the statistics a BatchNorm keeps: one with `track_running_stats=False` has none
    to average (no process group here: the sum is this rank's own)."""
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3, track_running_stats=False))
    batches = [(torch.randn(4, 3, 5, 5), torch.zeros(4))]
    assert update_bn(model, PassLoader(batches), Dist(0, 2, 0, torch.device("cpu")), None, False, epoch=0) == 1
    assert model[1].running_mean is None and model[0].running_mean.abs().sum() > 0


def test_update_bn_that_fails_leaves_the_momenta_and_the_mode_as_they_were():
    """A pass that stops with an error (a shard that fails to decode) restores what it changed for the pass."""
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.2), torch.nn.BatchNorm2d(3, momentum=None)).eval()

    class Failing(PassLoader):
        def __iter__(self):
            yield torch.randn(4, 3, 5, 5), torch.zeros(4)
            raise RuntimeError("a shard failed")

    with pytest.raises(RuntimeError, match="a shard failed"):
        update_bn(model, Failing(), Dist(0, 1, 0, torch.device("cpu")), None, False, epoch=0)
    assert [m.momentum for m in model] == [0.2, None] and not model.training
    assert not any(m._forward_pre_hooks for m in model)

def test_swa_schedule_anneals_from_the_schedule_to_the_swa_lr():
    base = warmup_cosine(100, 10, 0.0)
    factor = swa_schedule(base, swa_step=60, anneal_steps=10, swa_ratio=0.05)
    assert [factor(s) for s in range(60)] == [base(s) for s in range(60)]
    values = [factor(s) for s in range(60, 75)]
    assert base(60) > values[0] > values[4] > values[8] and values[9:] == [0.05] * 6
    assert swa_schedule(base, 60, 0, 0.05)(60) == 0.05 and swa_schedule(base, 60, 10, None) is base


@pytest.mark.parametrize("args, message", [
    (["--swa-lr", "0.01"], "--swa-lr and --swa-anneal-epochs set SWA's learning rate: give --swa-start too"),
    (["--swa-start", "4"], "--swa-start must be an epoch of the run, 0 to 3 (--epochs 4), got 4"),
    (["--swa-start", "2", "--swa-anneal-epochs", "1"],
     "--swa-anneal-epochs anneals the learning rate to --swa-lr: give --swa-lr too"),
])
def test_swa_usage_errors(shards, tmp_path, args, message):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "r"), "--epochs", "4",
                                           *args])
    assert result.exit_code == 2 and message in result.output
