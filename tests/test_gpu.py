"""The GPU paths: nvJPEG decoding (`device="mixed"`) and GPU operators. Skipped without a CUDA GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalifeed.pipelines import AugmentConfig, DetectionConfig, make_loader, resolve_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"a": 40, "b": 33, "c": 27}, size=(96, 128), samples_per_shard=32)[1]


def test_auto_picks_the_gpu():
    assert resolve_device("auto") == "gpu"


def test_the_stack_fits_this_gpu_node():
    """The check every command makes (dalifeed/stack.py) on a real GPU node: the driver runs torch's and DALI's
    CUDA major, they are one major, and both see the same GPUs."""
    from dalifeed.stack import stack_report

    report = stack_report()
    stack = report.stack
    assert report.problems == [] and report.device == "gpu"
    assert stack.dali_majors == (stack.torch_major,) and stack.torch_major <= stack.driver_major
    assert stack.dali_gpus == stack.torch_gpus == torch.cuda.device_count() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_training_batches_live_on_the_gpu(shards, dtype):
    loader = make_loader(shards, "train", 16, augment=AugmentConfig(image_size=64), device="gpu",
                         fp16=dtype == torch.float16)
    images, labels = next(iter(loader))
    assert images.is_cuda and labels.is_cuda
    assert images.shape == (16, 3, 64, 64) and images.dtype == dtype and labels.dtype == torch.int64
    assert len(list(loader)) == len(loader) == 100 // 16


def test_gpu_validation_matches_the_cpu_pipeline(shards):
    """nvJPEG and libjpeg-turbo round differently; the images must still agree closely, labels exactly."""
    gpu = [(x.cpu(), y.cpu()) for x, y in make_loader(shards, "train", 25, augment=AugmentConfig(image_size=64),
                                                      train=False, device="gpu")]
    cpu = list(make_loader(shards, "train", 25, augment=AugmentConfig(image_size=64), train=False, device="cpu"))
    for (xg, yg), (xc, yc) in zip(gpu, cpu):
        assert torch.equal(yg, yc)
        assert (xg - xc).abs().mean() < 0.02


def test_dali_gpu_loader_in_the_bench(shards):
    from dalifeed.bench.loaders import race_loader

    loader = race_loader("dali-gpu", imagefolder=shards, shards=shards, split="train", batch_size=8, image_size=32,
                          workers=2, device=torch.device("cuda"))
    images, _ = next(iter(loader))
    assert images.is_cuda and images.shape == (8, 3, 32, 32)


@pytest.mark.parametrize("device", ["gpu", "hybrid"])
def test_gpu_detection_loader_matches_the_cpu_boxes(tmp_path, device):
    """The detection graph with `mixed` decoding (or CPU decoding, `hybrid`): validation boxes and labels
    equal the CPU graph's (the boxes do not depend on the decoder), images close, everything on the GPU."""
    from dalifeed.convert.coco import CocoConfig, convert_coco
    from dalifeed.pipelines import make_detection_loader
    from helpers import write_coco

    images, annotations = write_coco(tmp_path / "coco")
    out = tmp_path / "out"
    convert_coco(CocoConfig(images=[images], annotations=[annotations], out=out, progress=False, workers=1))
    gpu = list(make_detection_loader(out, "mini", 4, detection=DetectionConfig(size=64), train=False, device=device))
    cpu = list(make_detection_loader(out, "mini", 4, detection=DetectionConfig(size=64), train=False, device="cpu"))
    for (gi, gt), (ci, ct) in zip(gpu, cpu):
        assert all(x.is_cuda for x in gi) and all(t["boxes"].is_cuda for t in gt)
        for a, b in zip(gt, ct):
            assert a["image_id"] == b["image_id"] and torch.equal(a["labels"].cpu(), b["labels"])
            torch.testing.assert_close(a["boxes"].cpu(), b["boxes"])
        for a, b in zip(gi, ci):
            assert (a.cpu() - b).abs().mean() < 0.05
    train = make_detection_loader(out, "mini", 4, detection=DetectionConfig(size=64), train=True, device=device)
    batch_images, targets = next(iter(train))
    assert len(batch_images) == 4 and batch_images[0].shape == (3, 64, 64)


@pytest.mark.parametrize("train", [True, False])
def test_hybrid_decodes_on_the_cpu_and_hands_out_gpu_batches(shards, train):
    """dali-hybrid: the CPU decoder, then crop/resize/normalise on the GPU. Validation (no randomness) agrees
    closely with the all-CPU graph: the same decoder, resize kernels on another device."""
    loader = make_loader(shards, "train", 25, augment=AugmentConfig(image_size=64), train=train, device="hybrid",
                         fp16=True)
    batches = [(x.cpu(), y.cpu()) for x, y in loader]
    assert all(x.dtype == torch.float16 and x.shape[1:] == (3, 64, 64) for x, _ in batches)
    assert len(batches) == len(loader)
    if not train:
        cpu = list(make_loader(shards, "train", 25, augment=AugmentConfig(image_size=64), train=False, device="cpu",
                               fp16=True))
        for (xh, yh), (xc, yc) in zip(batches, cpu):
            assert torch.equal(yh, yc)
            assert (xh.float() - xc.float()).abs().mean() < 0.01


@pytest.mark.parametrize("name", ["dali-hybrid", "dali-gpu"])
def test_bench_gpu_loaders_hand_out_fp16_on_the_gpu(shards, name):
    from dalifeed.bench.loaders import race_loader

    loader = race_loader(name, imagefolder=shards, shards=shards, split="train", batch_size=8, image_size=32,
                          workers=2, device=torch.device("cuda"), fp16=True, hw_decoder_load=0.99)
    images, labels = next(iter(loader))
    assert images.is_cuda and labels.is_cuda and images.dtype == torch.float16 and images.shape == (8, 3, 32, 32)


@pytest.mark.parametrize("load", [0.0, 0.99])
def test_mixed_checkpoint_restores_bit_identical_batches(shards, load):
    """DALI's checkpoint of a `mixed` random-crop decoder: a fresh loader restored from it yields exactly the
    batches the first one went on to yield (whichever decoder, hardware or CUDA, took the images)."""
    from dalifeed.bench.gpu_check import checkpoint_round_trip

    result = checkpoint_round_trip(shards, "gpu", batch_size=8, image_size=32, workers=2, before=3, after=4,
                                   hw_decoder_load=load)
    assert result["bit_identical"], result


def test_nccl_collectives_at_world_size_one():
    from dalifeed.bench.gpu_check import collectives

    result = collectives(has_gpu=True)
    assert result["backend"] == "nccl" and result["ok"], result


@pytest.mark.parametrize("extra", [["--device", "hybrid"], ["--device", "gpu", "--amp", "fp16"],
                                   ["--device", "gpu", "--synthetic", "--channels-last", "--amp", "bf16"]])
def test_dali_train_on_the_gpu(shards, tmp_path, extra):
    """One epoch through DALI's iterator into a CUDA model: hybrid decoding, fp16 with GradScaler, bf16
    channels-last on synthetic data."""
    import json

    from click.testing import CliRunner

    from dalifeed.train.cli import main as train_cli

    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), "--model", "resnet18",
                                            "--epochs", "1", "--batch-size", "16", "--image-size", "64",
                                            "--val-split", "none", *extra])
    assert result.exit_code == 0, result.output
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["images_per_s"] > 0 and record["gpu_max_memory_gb"] > 0


def test_gpu_check_end_to_end_small(tmp_path):
    import json

    from click.testing import CliRunner

    from dalifeed.bench.gpu_check import main as gpu_check_cli

    workdir = tmp_path / "gc"
    result = CliRunner().invoke(gpu_check_cli, [
        "--workdir", str(workdir), "--per-class", "40", "--batch-size", "32", "--image-size", "64", "--seconds", "1",
        "--repeats", "1", "--model", "resnet18", "--train-epochs", "2", "--hw-loads", "0,0.99",
        "--steps", "loaders,hw-decoder,train,checkpoint,nccl"])
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "gpu-check.json").read_text())
    names = [r["loader"] for r in report["loaders"]["results"]]
    assert names == ["baseline", "webdataset", "dali-cpu", "dali-hybrid", "dali-gpu"]
    assert [r["hw_decoder_load"] for r in report["hw_decoder"]["runs"]] == [0.0, 0.99]
    assert report["train"]["loader"] == "dali-gpu" and report["train"]["dali"]["gpu_util_percent"] is not None
    assert report["checkpoint"]["bit_identical"] and report["nccl"]["ok"]
    assert report["environment"]["driver"]


RECIPE_STEPS = ["recipe-imagenet", "recipe-ra", "recipe-ta_wide", "recipe-erase", "recipe-mixup-cutmix",
                "recipe-torchvision-resnet50", "multilabel", "detection"]


@pytest.mark.parametrize("step", RECIPE_STEPS)
def test_gpu_check_recipe_step(tmp_path, step):
    """Each training recipe on the GPU as gpu-check runs it (gpu_recipes.py): every output (float32/float16,
    NCHW/NHWC) decodes with nvJPEG at a measured rate, and the hybrid loader's first batch (CPU decoding, GPU
    kernels, the same random draws) matches the cpu loader's: the same targets, images within MATCH_TOLERANCE."""
    import json

    from click.testing import CliRunner

    from dalifeed.bench import gpu_recipes
    from dalifeed.bench.gpu_check import main as gpu_check_cli

    workdir = tmp_path / "gc"
    result = CliRunner().invoke(gpu_check_cli, [
        "--workdir", str(workdir), "--per-class", "40", "--batch-size", "32", "--image-size", "64",
        "--model", "resnet18", "--train-epochs", "2", "--recipe-batches", "3", "--coco-batch-size", "16",
        "--steps", step])
    assert result.exit_code == 0, result.output
    section = json.loads((workdir / "gpu-check.json").read_text())[step.replace("-", "_")]
    assert len(section["cases"]) == (1 if step == "detection" else 4)
    for case in section["cases"]:
        assert case["device"] == "gpu" and case["compared_device"] == "hybrid" and case["images_per_s"] > 0, case
        assert case["targets_equal"] and case["mean_abs_difference"] <= gpu_recipes.MATCH_TOLERANCE, case
        assert case["gpu_vs_cpu"]["targets_equal"], case  # nvJPEG decodes the same crops of the same samples


def allowed(function):
    """`function` run with torch's sync check off (what a slice lets through), back to "error" after it."""
    def let_through(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    return let_through


def slice_config(shards: Path, out: Path, amp: str):
    """Every per-step option on, as tests/test_train_sync.py's `sync_config`, on the GPU, with --swa-start."""
    from fast_recipe import fast_config

    cfg = fast_config(shards, out, width=8, amp=amp, ema=0.9, clip_grad=1.0, mixup_alpha=0.2, cutmix_alpha=1.0,
                      channels_last=True, label_smoothing=0.1, accum_steps=2, device="gpu", progress_every=1e-6,
                      tensorboard_every=1, max_bad_steps=10**6, val_split=None, epochs=2, swa_start=1, swa_lr=0.01,
                      swa_anneal_epochs=0.5)
    cfg.validate()
    out.mkdir()
    return cfg


def run_slice(run, patcher) -> None:
    """Two epochs and SWA's BatchNorm pass of `run` under `set_sync_debug_mode("error")`, the checks let
    through (`patcher`: a `pytest.MonkeyPatch`)."""
    from torch.nn.parallel import DistributedDataParallel

    from dalifeed.train import progress, stop, trainer
    from dalifeed.train.swa import update_bn

    patcher.setattr(stop, "CHECK_SECONDS", 1e9)
    patcher.setattr(trainer, "check", allowed(trainer.check))
    patcher.setattr(torch.cuda, "synchronize", allowed(torch.cuda.synchronize))
    for name in ("close", "snapshot"):
        patcher.setattr(progress.EpochProgress, name, allowed(getattr(progress.EpochProgress, name)))
    pre_forward = DistributedDataParallel._pre_forward

    def rebuilding_once(self, *args, **kwargs):  # DDP's one bucket rebuild reads the broadcast indices back
        return (pre_forward if self._has_rebuilt_buckets else allowed(pre_forward))(self, *args, **kwargs)

    patcher.setattr(DistributedDataParallel, "_pre_forward", rebuilding_once)
    for epoch in (0, 1):
        run.state.epoch = epoch
        run.start_epoch(epoch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            stats = trainer.train_one_epoch(run)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert stats.steps == len(run.train_loader) // 2
    torch.cuda.set_sync_debug_mode("error")
    try:
        update_bn(run.swa.module, run.train_loader, run.dist, run.dtype, run.cfg.channels_last, epoch=1)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_a_training_slice_syncs_only_at_the_checks(shards, tmp_path, monkeypatch, amp):
    """The sync test of tests/test_train_sync.py where it counts: on a GPU under
    `torch.cuda.set_sync_debug_mode("error")`, with every per-step option on, then SWA's BatchNorm pass. The
    mode raises at the synchronizing CUDA calls torch makes itself (an `.item()`, a blocking copy to the host,
    from Python or C++: c10/cuda/CUDAFunctions.h, `memcpy_and_sync`, `stream_synchronize`); only the checks,
    the epoch's end and the loss sum read there are let through, and `torch.cuda.synchronize` (the epoch's last
    line; a synchronize inside a step fails tests/test_train_sync.py, which counts every call).

    What the mode cannot see (its docstring leaves torch.distributed out; the rest are not torch's calls):
    DALI's host waits for its pipelines' outputs, cuDNN benchmark's timing of algorithms for each new shape
    (`cudnn.benchmark`, on in dali-train), and NCCL's collectives and their waits."""
    from dalifeed.train import trainer
    from dalifeed.train.distributed import Dist

    cfg = slice_config(shards, tmp_path / "run", amp)
    run = trainer.build_run(cfg, Dist(0, 1, 0, torch.device("cuda", torch.cuda.current_device())), resume=None)
    run_slice(run, monkeypatch)


def _slice_on_rank(rank: int, port: int, cfg) -> None:
    import torch.distributed as dist

    from dalifeed.train import trainer
    from dalifeed.train.distributed import Dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=device)
    try:
        run = trainer.build_run(cfg, Dist(rank, 2, rank, device), resume=None)
        patcher = pytest.MonkeyPatch()
        try:
            run_slice(run, patcher)
        finally:
            patcher.undo()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_two_rank_training_slice_syncs_only_at_the_checks(shards, tmp_path):
    """The same slice on 2 GPUs of one node (NCCL): DDP's gradient buckets and buffer broadcasts, the skip-step
    all-reduce, SWA's BatchNorm pass with its all-reduce. DDP's one bucket rebuild (its second forward:
    torch/csrc/distributed/c10d/reducer.cpp, `sync_bucket_indices`, copies the broadcast indices back to the
    host, non_blocking=false) is let through: once a run, not once a step."""
    from helpers import run_ranks

    run_ranks(_slice_on_rank, slice_config(shards, tmp_path / "run", "bf16"), timeout=600)
