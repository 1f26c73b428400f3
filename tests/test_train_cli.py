"""`dali-train` as a user runs it, at the edges: a second run into the same OUT is refused while a real process
holds its lock; SIGINT/SIGTERM stop after a checkpoint and the resumed run equals a straight one; a full disk
at a checkpoint is one line and leaves no half-written file; usage errors are one line naming the value; the
default warm-up and fp16 on the CPU (a warning); a resume on another world size keeps the global batch, or
says why it cannot."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.train import TrainConfig
from dalifeed.train import main as train
from dalifeed.train.cli import main as train_cli
from fast_recipe import fast_args
from helpers import hold_lock, limit_file_size, wait_for

PY = sys.executable
FAST = fast_args(width=16)


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=10)[1]


def test_two_trainings_into_one_out_are_refused(shards, tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        refused = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), "--epochs", "1", *FAST])
        assert refused.exit_code == 2 and f"in use by pid {holder.pid}" in refused.output
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_training_after_a_checkpoint_and_the_resume_equals_a_straight_run(shards, tmp_path, sig,
                                                                                          code):
    args = ["--data", str(shards), "--epochs", "3", *FAST]
    straight = tmp_path / "straight"
    assert CliRunner().invoke(train_cli, args + ["--out", str(straight)]).exit_code == 0
    run = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "dalifeed.train.cli", *args, "--out", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "metrics.jsonl").exists(), timeout=120, what="the first epoch")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    assert f"stopped by {sig.name}: continue with: dali-train --resume {run} (last.pt holds" in stderr
    assert "Traceback" not in stderr and "Aborted" not in stderr
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["state"]["epoch"] >= 1
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(run / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_at_a_checkpoint_is_one_line(shards, tmp_path):
    run = tmp_path / "run"
    command = [PY, "-m", "dalifeed.train.cli", "--data", str(shards), "--out", str(run), "--epochs", "1", *FAST]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, preexec_fn=limit_file_size(200_000))
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"{run}/last.pt: File too large" in errors[0], result.stderr[-2000:]
    assert "a checkpoint of this run takes about" in errors[0] and "Traceback" not in result.stderr
    assert not (run / "last.pt").exists() and not list(run.glob(".last.pt.tmp*"))


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "64"], "--batch-size 64 (x --accum-steps 1) is more than the 45 samples of split 'train'"),
    (["--workers", "-1"], "--workers must be >= 1 (DALI threads), got -1"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0, got -1.0"),
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
                                            "--amp", "fp16", *fast_args(width=16, warmup_epochs=None)])
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
    # the rule's other cases (processes that cannot share the global batch...): tests/test_train_resume.py


def test_help_shows_the_options_without_importing_torch():
    """`dali-train --help` reads its options from modules that do not import torch (it took 6.4 s when they did):
    torch, torchvision and the trainer are imported where a run starts."""
    probe = ("import sys; from click.testing import CliRunner; from dalifeed.train.cli import main; "
             "result = CliRunner().invoke(main, ['--help']); "
             "print(result.exit_code, '--auto-augment' in result.output, "
             "sorted(m for m in ('torch', 'torchvision', 'dalifeed.train.trainer') if m in sys.modules))")
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True", "[]"]


def test_the_names_dalifeed_train_lends_stay_after_their_modules_are_imported():
    """dalifeed.train lends its names on first use (for --help above); importing the trainer's modules must not
    put a module where a lent name was: no lent name is a submodule's name (the function `evaluate` lives in
    `.evaluation`), in any of the packages that lend names."""
    probe = ("import dalifeed.train as t, dalifeed.train.trainer; from dalifeed.train import evaluate, main; "
             "print(callable(t.evaluate), type(t.evaluate).__name__, evaluate is t.evaluate, main.__module__)")
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "function", "True", "dalifeed.train.trainer"]
    import importlib.util

    import dalifeed.convert
    import dalifeed.pipelines
    import dalifeed.train

    for package in (dalifeed.convert, dalifeed.pipelines, dalifeed.train):
        clashes = [name for name in package.__all__ if importlib.util.find_spec(f"{package.__name__}.{name}")]
        assert clashes == [], f"{package.__name__} lends names its submodules have: {clashes}"
