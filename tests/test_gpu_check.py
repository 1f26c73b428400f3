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

from dalifeed.bench import gpu_recipes
from dalifeed.bench.gpu_check import (
    STEPS,
    CheckRun,
    GpuCheckConfig,
    checkpoint_round_trip,
    collectives,
    decoder_budget,
    decoder_memory_line,
    failed,
    hw_decoder_config,
    render_markdown,
    run_check,
    train_command,
    train_slice,
)
from dalifeed.bench.gpu_check import main as gpu_check_cli
from dalifeed.budget import thread_budget
from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.stack import StackMismatch
from dalifeed.train.cli import main as train_cli
from dalifeed.train.data import SyntheticLoader

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
    assert train["dali_vs_synthetic"] == pytest.approx(train["dali"]["images_per_s"]
                                                        / train["synthetic"]["images_per_s"])
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
    assert (budget["threads"] == threads.threads != 64
            and budget["gpu_mib"] == threads.threads * budget["device_padding_mib"])
    assert budget["pinned_mib"] == threads.threads * 2 * budget["host_padding_mib"]
    text = (tmp_path / "gpu-check.md").read_text()
    assert f"dali-train's default with one rank per GPU here, {threads.describe()}" in text
    assert f"each rank's `mixed` decoder reserves {budget['gpu_mib']:.0f} MiB of GPU" in text
    assert "twice that at an epoch's boundary, with the next epoch's started" in text


def test_docs_quote_gpu_checks_decoder_line_for_8_gpus_on_64_cpus():
    line = decoder_memory_line(decoder_budget(cores=64, gpus=8, environ={}))
    doc = " ".join((Path(__file__).parents[1] / "docs" / "gpu.md").read_text().split())
    assert "threads per pipeline: 6" in line and "132 MiB of GPU and 180 MiB of pinned" in line
    assert line in doc


def test_synthetic_loader_repeats_one_batch_and_resumes_mid_epoch(shards):
    real = make_loader(shards, "train", 4, augment=AugmentConfig(image_size=24), device="cpu", num_threads=2,
                       train=True)
    synthetic = SyntheticLoader(make_loader(shards, "train", 4, augment=AugmentConfig(image_size=24), device="cpu",
                                            num_threads=2, train=True))
    batches = list(synthetic)
    assert len(batches) == len(synthetic) == len(real) == 52 // 4
    first_images, first_labels = batches[0]
    assert all(torch.equal(images, first_images) and torch.equal(labels, first_labels) for images, labels in batches)
    assert synthetic.epoch == 1
    partway = iter(synthetic)
    for _ in range(5):
        next(partway)
    state = synthetic.state_dict()
    assert state == {"epoch": 1, "samples_done": 5 * 4, "dali": None}
    resumed = SyntheticLoader(make_loader(shards, "train", 4, augment=AugmentConfig(image_size=24), device="cpu",
                                          num_threads=2, train=True))
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



# -- the recipe steps (gpu_recipes.py), the hw-decoder sweep's threads and the training slice's ranks ------------

def test_help_lists_every_step():
    result = CliRunner().invoke(gpu_check_cli, ["--help"])
    assert result.exit_code == 0
    listed = [line.split()[0] for line in result.output.split("Steps (--steps), in order:")[1].splitlines()[1:16]]
    assert listed == list(STEPS)
    assert list(STEPS)[7:] == ["recipe-imagenet", "recipe-ra", "recipe-ta_wide", "recipe-erase", "recipe-mixup-cutmix",
                               "recipe-torchvision-resnet50", "multilabel", "detection"]


RECIPE_ARGS = [*SMALL, "--recipe-batches", "2", "--coco-batch-size", "8"]


@pytest.mark.slow
def test_every_recipe_step_runs_each_output_and_matches_the_cpu_path(tmp_path):
    """Every recipe step on the CPU (--allow-cpu): each of float32/float16 x NCHW/NHWC (detection: one) gives
    images/s and a first batch equal to a second loader's with the same seed; the torchvision-resnet50 step also
    trains with --recipe; gpu-check.md has a table per step."""
    workdir = tmp_path / "gc"
    steps = [name for name in STEPS if name in gpu_recipes.RECIPES]
    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(workdir), "--allow-cpu", *RECIPE_ARGS,
                                                "--steps", ",".join(steps)])
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "gpu-check.json").read_text())
    outputs = ["float32 NCHW", "float16 NCHW", "float32 NHWC", "float16 NHWC"]
    for name in steps:
        section = report[name.replace("-", "_")]
        assert [c["output"] for c in section["cases"]] == (["float32 NCHW"] if name == "detection" else outputs), name
        for case in section["cases"]:
            assert case["images_per_s"] > 0 and case["device"] == case["compared_device"] == "cpu", (name, case)
            assert case["matches_cpu"] and case["mean_abs_difference"] == 0 and case["targets_equal"], (name, case)
            assert case["checksum"] == case["cpu_checksum"] != 0, (name, case)
        assert f"### {name}: " in (workdir / "gpu-check.md").read_text()
    half, single = report["recipe_erase"]["cases"][1], report["recipe_erase"]["cases"][0]
    assert half["checksum"] == pytest.approx(single["checksum"], rel=1e-3) and half["checksum"] != single["checksum"]
    train = report["recipe_torchvision_resnet50"]["train"]
    assert train["command"].endswith("--recipe torchvision-resnet50") and train["images_per_s"] > 0
    assert report["recipe_torchvision_resnet50"]["mixup_alpha"] == 0.2
    assert report["multilabel"]["task"] == "multilabel" and report["detection"]["batch_size"] == 8


def test_a_batch_that_differs_from_the_cpu_path_fails_the_check():
    images, labels = torch.zeros(2, 3, 4, 4, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)
    same = gpu_recipes.compare((images, labels), (images.clone(), labels.clone()))
    assert same == {"checksum": 0.0, "cpu_checksum": 0.0, "targets_equal": True, "mean_abs_difference": 0.0,
                    "max_abs_difference": 0.0}
    shifted = gpu_recipes.compare((images + 0.5, labels.flip(0)), (images, labels))
    assert (shifted["checksum"], shifted["targets_equal"], shifted["mean_abs_difference"]) == (48.0, False, 0.5)
    other_shape = gpu_recipes.compare((images[:1], labels[:1]), (images, labels))
    assert other_shape["mean_abs_difference"] is None and not other_shape["targets_equal"]
    case = {"output": "float16 NHWC", "matches_cpu": False}
    assert gpu_recipes.failed_cases({"recipe_ra": {"cases": [case]}}) == ["recipe-ra float16 NHWC"]
    assert failed({"recipe_ra": {"cases": [case]}})
    assert not failed({"recipe_ra": {"cases": [{**case, "matches_cpu": True}]}})


def test_the_training_slice_runs_the_nodes_ranks_under_torchrun(tmp_path):
    cfg = GpuCheckConfig(workdir=tmp_path, model="resnet18")
    two = train_command(cfg, tmp_path / "shards", tmp_path / "out", True, synthetic=False, ranks=8,
                        extra=["--recipe", "torchvision-resnet50"])
    assert two[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", "-m"]
    assert two[7] == "dalifeed.train.cli" and two[-2:] == ["--recipe", "torchvision-resnet50"]
    assert "--dali-threads" not in two  # each rank takes dali-train's own budget for 8 ranks on the node
    one = train_command(cfg, tmp_path / "shards", tmp_path / "out", False, synthetic=True)
    assert one[1:3] == ["-m", "dalifeed.train.cli"] and one[-1] == "--synthetic"
    assert CheckRun(cfg, has_gpu=False).train_ranks == 1
    assert CheckRun(GpuCheckConfig(workdir=tmp_path, train_ranks=2), has_gpu=False).train_ranks == 2


@pytest.mark.slow
def test_a_two_rank_training_slice_runs_on_the_cpu(tmp_path, shards):
    """The slice as a node runs it, for real: torchrun with two ranks (gloo here), the node's images/s."""
    cfg = GpuCheckConfig(workdir=tmp_path, batch_size=4, image_size=24, model="resnet18", width=8, train_epochs=2,
                         train_ranks=2, workers=1)
    run = CheckRun(cfg, has_gpu=False, log=lambda msg: None)
    run.photo_set = (None, shards)  # the module's small shards in place of the photo set
    result = train_slice(run, "two", synthetic=True)
    assert result["ranks"] == 2 and result["images_per_s"] > 0 and "--nproc-per-node 2" in result["command"]
    log = (tmp_path / "train-two" / "train.log").read_text()
    assert "world size 2 (ranks from process group), device cpu" in log, log[-2000:]


def test_the_hw_decoder_sweep_runs_at_one_ranks_dali_threads(tmp_path):
    """The sweep's dali-gpu gets the threads dali-train gives one rank of this node (one rank per GPU), not
    --workers (every CPU): a rank never has them all (issue 28, finding 4)."""
    cfg = GpuCheckConfig(workdir=tmp_path, per_class=8, batch_size=8, workers=64, allow_cpu=True)
    run = CheckRun(cfg, has_gpu=False, log=lambda msg: None)
    threads = decoder_budget()["threads"]
    bench = hw_decoder_config(run, threads)
    assert bench.loaders == ["dali-gpu"] and bench.workers == threads != 64


def test_the_defaults_step_measures_threads_and_prefetch_within_a_ranks_cpus(tmp_path):
    """gpu-check's `defaults` step times the training graph at the DALI threads one rank may use (of 4, 6 and 8;
    here fewer CPUs than 4, so the rank's share) and prefetch queues of 2 and 5, and reports the best beside
    what dalifeed would use on this node."""
    from dalifeed.bench.gpu_check import decoder_budget
    from dalifeed.bench.gpu_defaults import thread_choices

    assert thread_choices(64) == [4, 6, 8] and thread_choices(6) == [4, 6] and thread_choices(2) == [2]
    workdir = tmp_path / "gc"
    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(workdir), "--allow-cpu", *SMALL,
                                                "--recipe-batches", "2", "--steps", "defaults"])
    assert result.exit_code == 0, result.output
    found = json.loads((workdir / "gpu-check.json").read_text())["defaults"]
    budget = decoder_budget()
    expected_threads = thread_choices(max(1, budget["cores"] // budget["ranks_on_node"]))
    assert [(r["threads"], r["prefetch_queue_depth"]) for r in found["runs"]] == \
        [(t, d) for t in expected_threads for d in (2, 5)]
    assert found["best"] in found["runs"] and all(r["images_per_s"] > 0 for r in found["runs"])
    assert found["default"] == {"threads": budget["threads"], "prefetch_queue_depth": 2}  # the CPU path: DALI's 2
    assert "### Loader defaults" in (workdir / "gpu-check.md").read_text()
