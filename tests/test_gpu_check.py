"""`make gpu-check` and the parts it adds: the check's own steps on the CPU (`--allow-cpu`), its refusal
without a GPU, `dali-train --synthetic` and the devices that need a GPU. The same steps on a GPU are in
test_gpu.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.bench.gpu_check import (GpuCheckConfig, checkpoint_round_trip, collectives, decoder_budget,
                                      decoder_memory_line, main as gpu_check_cli, render_markdown, run_check)
from dalifeed.pipelines import make_loader
from dalifeed.pipelines.budget import thread_budget
from dalifeed.stack import StackMismatch
from dalifeed.train.cli import main as train_cli
from dalifeed.train.synthetic import SyntheticLoader

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")

SMALL = ["--per-class", "8", "--batch-size", "8", "--image-size", "32", "--seconds", "0.3", "--repeats", "1",
         "--workers", "2", "--model", "resnet18", "--width", "8", "--train-epochs", "2"]


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"a": 20, "b": 17, "c": 15}, size=(40, 52), samples_per_shard=8)[1]


@no_gpu
def test_gpu_check_refuses_a_machine_without_a_gpu(tmp_path):
    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(tmp_path / "gc")])
    assert result.exit_code == 2, result.output
    assert "no CUDA GPU visible" in result.output and "--allow-cpu" in result.output
    assert [line for line in result.output.splitlines() if line.startswith("Error:")] == \
        [result.output.strip().splitlines()[-1]]  # click's usage hint, then the one line; no traceback


def test_gpu_check_options_are_checked(tmp_path):
    for args, message in ((["--steps", "loaders,bogus"], "unknown bogus"), (["--hw-loads", "0,1.5"], "[0, 1]"),
                          (["--hw-loads", "half"], "comma-separated list of float")):
        result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(tmp_path / "gc"), "--allow-cpu", *args])
        assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
def test_gpu_check_runs_its_steps_on_the_cpu_and_merges_calls(tmp_path):
    """Every step that can run without a GPU, on the photo set: the report holds measured numbers, the GPU-only
    parts say they were skipped, and a later call with other steps keeps the earlier sections."""
    workdir = tmp_path / "gc"
    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(workdir), "--allow-cpu", *SMALL,
                                                "--steps", "loaders,hw-decoder,train,checkpoint"])
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "gpu-check.json").read_text())
    loaders = {r["loader"]: r for r in report["loaders"]["results"]}
    assert set(loaders) == {"baseline", "webdataset", "dali-cpu"}  # dali-hybrid and dali-gpu need a GPU
    assert all(r["images_per_s"] > 0 and r["output"] == "(8, 3, 32, 32) float16 cpu" for r in loaders.values())
    assert report["hw_decoder"] == {"skipped": "no GPU"}
    train = report["train"]
    assert train["loader"] == "dali-cpu" and "--synthetic" in train["synthetic"]["command"]
    assert Path(train["dali"]["profile_trace"]).name == "profile_trace.json" and not train["synthetic"]["profile_trace"]
    assert json.loads(Path(train["dali"]["profile_trace"]).read_text())["traceEvents"]
    assert train["dali"]["images_per_s"] > 0 and train["synthetic"]["images_per_s"] > 0
    assert train["synthetic"]["data_wait_share"] < 0.05  # its batches are ready-made
    assert train["dali_vs_synthetic"] == pytest.approx(train["dali"]["images_per_s"] / train["synthetic"]["images_per_s"])
    assert report["checkpoint"]["bit_identical"] and report["checkpoint"]["device"] == "cpu"
    assert report["environment"]["gpu"] is None and report["environment"]["dali"]
    assert [g["goal"].split()[0] for g in report["goals"]] == ["resnet18"]  # no dali-gpu: no speed-up goal
    markdown = (workdir / "gpu-check.md").read_text()
    for section in ("### Loaders", "| dali-cpu |", "### hw_decoder_load", "training slice", "bit-identical: yes"):
        assert section in markdown
    assert markdown in result.output

    again = CliRunner().invoke(gpu_check_cli, ["--workdir", str(workdir), "--allow-cpu", *SMALL, "--steps", "nccl"])
    assert again.exit_code == 0, again.output
    merged = json.loads((workdir / "gpu-check.json").read_text())
    assert merged["loaders"] == report["loaders"] and merged["train"] == report["train"]
    assert merged["nccl"]["ok"] and merged["nccl"]["backend"] == "gloo"
    assert "gloo at world size 1: ok" in (workdir / "gpu-check.md").read_text()


def test_a_failing_step_is_reported_and_fails_the_check(tmp_path):
    """A step that raises is named in the report and the exit code, and the other steps still run."""
    workdir = tmp_path / "gc"
    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(workdir), "--allow-cpu", *SMALL[:-2],
                                                "--per-class", "1", "--batch-size", "64", "--steps", "checkpoint,nccl"])
    assert result.exit_code == 1, result.output
    report = json.loads((workdir / "gpu-check.json").read_text())
    assert "checkpoint" in report["errors"] and report["nccl"]["ok"]
    assert "### Steps that failed" in (workdir / "gpu-check.md").read_text()


def test_checkpoint_step_compares_restored_batches(shards):
    result = checkpoint_round_trip(shards, "cpu", batch_size=4, image_size=24, workers=2, before=2, after=3)
    assert result["bit_identical"] and result["max_abs_difference"] == 0
    assert result["batches_compared"] == 3 and result["state_bytes"] > 0
    # saving serialises a state (milliseconds); restoring builds a pipeline and runs it to a batch
    assert 0 < result["save_seconds"] < result["restore_to_first_batch_seconds"]


def test_collectives_at_world_size_one():
    result = collectives(has_gpu=False)
    assert result == {"backend": "gloo", "world_size": 1, "ok": True,
                      "note": "no GPU: gloo, the CPU backend, in place of NCCL"}


def test_markdown_names_goals_missed_and_met():
    report = {"environment": {"date": "d", "gpu": "H100", "cores": 16, "cpu": "x", "cuda": "13", "cudnn": 9,
                              "torch": "t", "torchvision": "tv", "dali": "2.4", "webdataset": "w", "python": "3.12"},
              "goals": [{"goal": "dali-gpu >= 8x the DataLoader baseline", "value": "5.00x", "met": False}]}
    text = render_markdown(report)
    assert "GPU H100" in text and "| dali-gpu >= 8x the DataLoader baseline | 5.00x | no |" in text


def test_report_states_what_the_mixed_decoder_of_a_dali_train_rank_reserves(tmp_path):
    """The first lines of a gpu-check report: the decoder memory of a dali-train rank at dali-train's default
    thread budget (one rank per GPU), whatever gpu-check's own --workers (issue 19, finding 1: 64 threads used
    to reserve 13.5 GB of GPU and 18 GB of pinned memory)."""
    report = run_check(GpuCheckConfig(workdir=tmp_path, steps=[], workers=64, allow_cpu=True), log=lambda msg: None)
    assert (report["stack"]["ok"], report["stack"]["device_auto"]) == (True, "cpu")  # the stack check, recorded first
    budget = report["decoder_memory"]
    gpus = torch.cuda.device_count()
    threads = thread_budget("gpu", visible_gpus=gpus, environ={**os.environ, "LOCAL_WORLD_SIZE": str(max(1, gpus))})
    assert budget["threads"] == threads.threads != 64 and budget["gpu_mib"] == threads.threads * budget["device_padding_mib"]
    assert budget["pinned_mib"] == threads.threads * 2 * budget["host_padding_mib"]
    text = (tmp_path / "gpu-check.md").read_text()
    assert f"dali-train's default with one rank per GPU here, {threads.describe()}" in text
    assert f"each rank's `mixed` decoder reserves {budget['gpu_mib']:.0f} MiB of GPU" in text and "holds two" not in text


def test_docs_quote_gpu_checks_decoder_line_for_8_gpus_on_64_cpus():
    line = decoder_memory_line(decoder_budget(cores=64, gpus=8, environ={}))
    doc = " ".join((Path(__file__).parents[1] / "docs" / "gpu.md").read_text().split())
    assert "threads per pipeline: 4" in line and "88 MiB of GPU and 120 MiB of pinned" in line
    assert line in doc


def test_synthetic_loader_repeats_one_batch_and_resumes_mid_epoch(shards):
    real = make_loader(shards, "train", 4, device="cpu", image_size=24, num_threads=2, train=True)
    synthetic = SyntheticLoader(make_loader(shards, "train", 4, device="cpu", image_size=24, num_threads=2, train=True))
    batches = list(synthetic)
    assert len(batches) == len(synthetic) == len(real) == 52 // 4
    first_images, first_labels = batches[0]
    assert all(torch.equal(images, first_images) and torch.equal(labels, first_labels) for images, labels in batches)
    assert synthetic.epoch == 1
    partway = iter(synthetic)
    for _ in range(5):
        next(partway)
    state = synthetic.state_dict()
    assert state == {"epoch": 1, "batches_done": 5, "dali": None}
    resumed = SyntheticLoader(make_loader(shards, "train", 4, device="cpu", image_size=24, num_threads=2, train=True))
    resumed.load_state_dict(state)
    assert len(list(resumed)) == len(real) - 5 and resumed.epoch == 2


def test_synthetic_training_runs_the_same_trainer(shards, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), "--model", "resnet18", "--width",
                                            "8", "--epochs", "1", "--batch-size", "8", "--image-size", "32",
                                            "--synthetic", "--device", "cpu", "--val-split", "none"])
    assert result.exit_code == 0, result.output
    assert "synthetic data (one batch, repeated)" in result.output
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["images_per_s"] > 0 and json.loads((run / "config.json").read_text())["synthetic"] is True


@no_gpu
@pytest.mark.parametrize("device", ["gpu", "hybrid"])
def test_gpu_devices_are_refused_in_one_line_without_a_gpu(shards, tmp_path, device):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "r"), "--device", device])
    assert result.exit_code == 2 and f"--device {device} needs a CUDA GPU and this node has none" in result.output, \
        result.output
    with pytest.raises(StackMismatch, match=f"--device {device} needs a CUDA GPU and this node has none"):
        make_loader(shards, "train", 4, device=device)

