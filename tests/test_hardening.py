"""The edges around the happy paths: signals and dead parents, one run per folder, full disks, options that
used to surprise, dali-bench refusing to measure nothing, and `shard-convert info`. Real processes, real
locks, real file-size limits."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from click.testing import CliRunner

from dalifeed.bench.cli import LOADER_COLOURS, figure, main as bench_cli
from dalifeed.cliutil import parse_size
from dalifeed.tools import ConvertConfig, convert_imagefolder
from dalifeed.tools.cli import main as convert_cli
from dalifeed.train import TrainConfig, main as train
from dalifeed.train.cli import main as train_cli

from helpers import write_imagefolder

PY = sys.executable
FAST = ["--model", "resnet18", "--width", "16", "--image-size", "16", "--batch-size", "8", "--optimizer", "adamw",
        "--lr", "0.032", "--crop-scale", "0.5,1", "--workers", "2"]


def wait_for(condition, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def same_outputs(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix in (".tar", ".idx")) + ["manifest.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> tuple[Path, Path]:
    """Enough images that a conversion runs for a while in 2 workers, and its uninterrupted result."""
    tmp = tmp_path_factory.mktemp("big")
    src = write_imagefolder(tmp / "src", {"a": 400, "b": 401}, size=(96, 96))
    convert_imagefolder(ConvertConfig(src=src, out=tmp / "ref", samples_per_shard=5, workers=1, progress=False))
    return src, tmp / "ref"


def start_conversion(src: Path, out: Path, **popen) -> subprocess.Popen:
    command = [PY, "-m", "dalifeed.tools.cli", "imagefolder", str(src), str(out), "--samples-per-shard", "5",
               "--workers", "2"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    wait_for(lambda: len(psutil.Process(proc.pid).children()) >= 2, what="conversion workers")
    return psutil.Process(proc.pid).children()


def gone(processes: list[psutil.Process]) -> bool:
    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in processes)


def test_sigterm_to_the_converter_stops_cleanly_and_a_rerun_resumes(big_source, tmp_path):
    src, reference = big_source
    out = tmp_path / "out"
    proc = start_conversion(src, out)
    workers = workers_of(proc)
    wait_for(lambda: len(list(out.glob("train-*.tar"))) >= 3, what="three shards")
    proc.send_signal(signal.SIGTERM)  # to the main process only, as `kill PID` or a scheduler does
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "stopped by SIGTERM: finished shards" in stderr and "run the same command again to resume" in stderr
    assert "Traceback" not in stderr
    wait_for(lambda: gone(workers), timeout=10, what="the workers to exit")
    assert not (out / "manifest.json").exists()
    rerun = start_conversion(src, out)
    stdout, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and "(resumed)" in stdout, stderr
    same_outputs(reference, out)


def test_workers_die_with_a_killed_converter(big_source, tmp_path):
    src, _ = big_source
    proc = start_conversion(src, tmp_path / "out")
    workers = workers_of(proc)
    proc.kill()  # SIGKILL to the main process only: the OOM killer, a lost node's agent
    proc.wait()
    # before: both workers stayed alive, blocked on a pipe nobody read
    wait_for(lambda: gone(workers), timeout=10, what="the orphaned workers to die")


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another real process holding the folder's lock, as a running conversion or training would."""
    code = ("import sys, time; from dalifeed.runtime import folder_lock\n"
            f"with folder_lock({str(folder)!r}, 'a test holder'):\n    print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_one_run_per_folder_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    out = tmp_path / "out"
    holder = hold_lock(out)
    refused = CliRunner().invoke(convert_cli, ["imagefolder", str(src), str(out)])
    assert refused.exit_code == 2 and f"in use by pid {holder.pid} (a test holder" in refused.output
    assert not (out / "manifest.json").exists()
    holder.kill()  # kill -9: the kernel drops the lock with the process
    holder.wait()
    assert CliRunner().invoke(convert_cli, ["imagefolder", str(src), str(out)]).exit_code == 0


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


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_is_one_line_and_the_conversion_resumes(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 30, "b": 31}, size=(64, 64))
    reference = convert_imagefolder(ConvertConfig(src=src, out=tmp_path / "ref", samples_per_shard=40, workers=1,
                                                  progress=False))
    out = tmp_path / "out"
    command = [PY, "-m", "dalifeed.tools.cli", "imagefolder", str(src), str(out), "--samples-per-shard", "40"]
    full = subprocess.run(command, capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size(40_000))
    assert full.returncode == 1, full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in full.stderr
    assert f"{out}/train-000000.tar: File too large" in errors[0]
    assert "need about" in errors[0] and "run the same command again to resume" in errors[0]
    assert not list(out.glob(".*.tmp*"))  # nothing half-written is left behind
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    same_outputs(reference.root, out)


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
    # the rule's other cases (processes that cannot share the global batch...): tests/test_train_resume.py


def test_sizes_mean_what_their_units_say():
    assert parse_size("512MB") == 512 * 10**6 and parse_size("256MiB") == 256 * 2**20
    assert parse_size("1.5KB") == 1500 and parse_size("1KiB") == 1024 and parse_size("4096") == 4096
    for bad, why in (("64Kb", "'b' is a bit"), ("64K", "write KB"), ("twelve", "not a size"), ("5XB", "unknown unit")):
        with pytest.raises(ValueError, match=why):
            parse_size(bad)


def test_both_shard_limits_hold_and_an_oversized_sample_is_reported(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 20, "b": 21}, size=(64, 64))
    manifest = convert_imagefolder(ConvertConfig(src=src, out=tmp_path / "both", samples_per_shard=8,
                                                 max_shard_bytes=12_000, progress=False))
    shards = manifest.splits["train"].shards
    assert max(s.samples for s in shards) <= 8 and max(s.bytes for s in shards) <= 12_000 + 10240
    assert min(s.samples for s in shards) < 8  # the byte limit, not only the count, ended some shards
    tiny = convert_imagefolder(ConvertConfig(src=src, out=tmp_path / "tiny", max_shard_bytes=4096, progress=False))
    assert len(tiny.warnings) == 41 and "alone is" in tiny.warnings[0] and "over --max-shard-bytes 4096" in tiny.warnings[0]
    result = CliRunner().invoke(convert_cli, ["info", str(tmp_path / "tiny")])
    assert "warning: train-000000.tar: sample" in result.output


def test_a_rerun_with_other_options_names_them(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    out = tmp_path / "out"
    assert CliRunner().invoke(convert_cli, ["imagefolder", str(src), str(out), "--seed", "1"]).exit_code == 0
    refused = CliRunner().invoke(convert_cli, ["imagefolder", str(src), str(out), "--seed", "2", "--jpeg-quality", "80"])
    assert refused.exit_code == 2
    assert "--jpeg-quality was 95, now 80; --seed was 1, now 2" in refused.output


def test_verify_writes_its_report_on_stdout(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    convert_imagefolder(ConvertConfig(src=src, out=tmp_path / "out", progress=False))
    tar = tmp_path / "out" / "train-000000.tar"
    tar.write_bytes(tar.read_bytes()[:-2000])
    report = tmp_path / "report.txt"
    with open(report, "w") as f:
        code = subprocess.run([PY, "-m", "dalifeed.tools.cli", "verify", str(tmp_path / "out")], stdout=f,
                              stderr=subprocess.PIPE, timeout=120).returncode
    lines = report.read_text().splitlines()
    assert code == 1 and any("train-000000.tar" in line for line in lines) and "problem(s)" in lines[-1]


def test_info_shows_classes_reasons_options_and_indexes(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"cat": 7, "dog": 5})
    (src / "cat" / "notes.txt").write_text("no image")
    out = tmp_path / "out"
    convert_imagefolder(ConvertConfig(src=src, out=out, val_fraction=0.3, progress=False))
    (out / "val-000000.idx").unlink()
    info = json.loads(CliRunner().invoke(convert_cli, ["info", str(out), "--json"]).output)
    # cat: 8 files, 2 to val, and the non-image drawn into train is skipped; dog: 5 files, round(1.5) = 2 to val
    assert info["splits"]["train"]["class_counts"] == {"cat": 5, "dog": 3}
    assert info["splits"]["val"]["class_counts"] == {"cat": 2, "dog": 2}
    assert info["splits"]["val"]["indexes_missing"] == ["val-000000.idx"] and info["options"]["val_fraction"] == 0.3
    assert info["skipped"] == {"not an image (no known image format, PIL cannot identify it)": 1}
    text = CliRunner().invoke(convert_cli, ["info", str(out)]).output
    assert "train: 8 samples in 1 shards" in text and "cat 5 (62.5%), dog 3 (37.5%)" in text
    assert "DALI indexes 1 MISSING (e.g. val-000000.idx)" in text


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    src = write_imagefolder(tmp / "src", {"a": 11, "b": 9}, size=(40, 52))
    convert_imagefolder(ConvertConfig(src=src, out=tmp / "shards", samples_per_shard=8, progress=False))
    return src, tmp / "shards"


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "dalifeed.bench.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_refuses_a_split_smaller_than_a_batch_instead_of_hanging(bench_data, tmp_path):
    src, shards = bench_data
    result = run_bench("--imagefolder", str(src), "--shards", str(shards), "--batch-size", "64", "--out",
                       str(tmp_path / "b"))
    assert result.returncode == 2 and "holds 20 images, fewer than one batch of --batch-size 64" in result.stderr


def test_bench_refuses_different_data_unless_allowed(bench_data, tmp_path):
    src, shards = bench_data
    other = write_imagefolder(tmp_path / "other", {"a": 11, "b": 9}, size=(80, 96), seed=5)
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(other), "--shards", str(shards), "--batch-size", "4"])
    assert result.exit_code == 2 and "not the same data" in result.output
    assert "the same number of files, but other names or sizes" in result.output
    allowed = CliRunner().invoke(bench_cli, ["--imagefolder", str(other), "--shards", str(shards), "--batch-size", "4",
                                             "--loaders", "dali-cpu", "--seconds", "0.2", "--repeats", "1",
                                             "--allow-different-data", "--out", str(tmp_path / "b")])
    assert allowed.exit_code == 0, allowed.output


def test_bench_model_timing_says_how_long_and_plots_both_panels(bench_data, tmp_path):
    src, shards = bench_data
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(src), "--shards", str(shards), "--batch-size", "4",
                                            "--image-size", "32", "--loaders", "dali-cpu", "--seconds", "0.2",
                                            "--repeats", "1", "--model", "resnet18", "--model-steps", "2",
                                            "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "resnet18 on synthetic data: 5 steps, about" in result.output and "s a step" in result.output
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    fig = figure(report)
    data, model = fig.axes
    assert data.patches[0].get_facecolor()[:3] == pytest.approx(_rgb(LOADER_COLOURS["dali-cpu"]))
    assert "src (train, 20 images), 32 px" in fig._suptitle.get_text()
    assert "resnet18 training" in model.get_title() and len(model.patches) == 1


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
