"""Training options that used to surprise: usage errors are one line naming the value; the default warm-up
and fp16 on the CPU (a warning); a resume on another world size keeps the global batch, or says why it
cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.format import ShardManifest
from dalifeed.train import TrainConfig, main as train
from dalifeed.train.cli import main as train_cli
from dalifeed.train.distributed import Dist
from dalifeed.train.trainer import check_resumable

FAST = ["--model", "resnet18", "--width", "16", "--image-size", "16", "--batch-size", "8", "--optimizer", "adamw",
        "--lr", "0.032", "--crop-scale", "0.5,1", "--workers", "2"]


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=10)[1]


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "64"], "--batch-size 64 (x --accum-steps 1) is more than the 45 training samples"),
    (["--workers", "-1"], "--workers must be >= 1 (DALI threads), got -1"),
    (["--warmup-epochs", "3"], "--warmup-epochs 3.0 must be in [0, --epochs 1]"),
])
def test_training_usage_errors_are_one_line(shards, tmp_path, extra, message):
    options = dict(zip(FAST[::2], FAST[1::2]))
    options.update(dict(zip(extra[::2], extra[1::2])))
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), "--epochs", "1",
                                            *[x for item in options.items() for x in item]])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # fp16's scaler skips its first step
def test_one_epoch_with_default_warm_up_runs_and_fp16_on_the_cpu_warns(shards, tmp_path):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), "--epochs", "1",
                                            "--amp", "fp16", *FAST])
    assert result.exit_code == 0, result.output
    assert "warning: --amp fp16 on the CPU runs about 10x slower" in result.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["warmup_epochs"] == 0.1


def test_a_resume_on_another_world_size_keeps_the_global_batch(shards, tmp_path):
    run = tmp_path / "run"
    train(TrainConfig(data=str(shards), out=str(run), epochs=1, model="resnet18", width=16, image_size=16,
                      batch_size=8, workers=2))
    saved = torch.load(run / "last.pt", weights_only=False)
    saved["world_size"] = 2  # as if two processes of batch 8 had trained it: global batch 16
    torch.save(saved, run / "last.pt")
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2"])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming on 1 processes (trained on 2): --batch-size 8 -> 16 per process keeps the global batch 16" \
        in resumed.output and "global batch 16 (lr" in resumed.output
    cfg = TrainConfig.from_json(saved["config"])
    with pytest.raises(Exception, match="3 processes cannot share it evenly"):
        check_resumable(cfg, Dist(0, 3, 0, torch.device("cpu")), saved, ShardManifest.load(shards))
