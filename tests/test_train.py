"""dali-train on real shards through the real DALI loader, on the CPU."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.train import TrainConfig, checkpoint
from dalifeed.train import main as train
from dalifeed.train.cli import main as train_cli
from dalifeed.train.distributed import Dist
from dalifeed.train.models import build_model
from dalifeed.train.run import Run, RunLog, epoch_score
from dalifeed.train.trainer import (
    amp_dtype,
    build_optimizer,
    make_model,
    param_groups,
    skips_on_device,
    train_one_epoch,
    warmup_cosine,
)
from fast_recipe import fast_args, fast_config
from helpers import write_imagefolder


def fast_cli_args(shards: Path, epochs: int, **overrides) -> list[str]:
    """The fast recipe as a dali-train command line (without --out), for the tests that run the CLI."""
    return ["--data", str(shards), *fast_args(epochs=epochs, **overrides)]


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """3 colour-coded classes: 45 train (odd), 21 val images. Learnable in a few epochs."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    return shards


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def deterministic(records: list[dict]) -> list[dict]:
    """The fields that must repeat exactly (timings never do)."""
    keys = ("epoch", "lr", "train_loss", "val_loss", "top1", "top5", "val_samples", "bad_steps")
    return [{k: r[k] for k in keys} for r in records]


@pytest.mark.learns
def test_short_training_learns_and_writes_its_outputs(shards, tmp_path, seed):
    run = tmp_path / "run"
    # 40 steps at 32 px, measured for seeds 0-4 under AVX-512, AVX2 and SSE4.1 kernels: top-1 1.0 (chance is
    # 0.33), validation loss <= 0.24 (ln 3 = 1.1 for a model that learnt nothing), the last epoch's mean train
    # loss 0.39-0.59 x the first epoch's
    result = train(fast_config(shards, run, epochs=8, seed=seed, image_size=32))
    records = metrics(run)
    assert [r["epoch"] for r in records] == list(range(8))
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]  # each the mean over 5 steps
    assert records[-1]["top1"] >= 0.9  # colour-coded classes: a working pipeline gets them all
    assert records[-1]["val_loss"] < 0.6  # and is confident about it (a broken one sits at ln 3 = 1.1)
    assert all(r["val_samples"] == 21 for r in records)
    assert records[-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # cosine ends at min_lr_ratio 0
    assert json.loads((run / "config.json").read_text())["model"] == "resnet18"
    assert (run / "last.pt").is_file() and (run / "best.pt").is_file()
    ckpt = torch.load(run / "last.pt", weights_only=False)
    assert ckpt["state"]["epoch"] == 8 and ckpt["classes"] == ["blue", "green", "red"]
    weights = result.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in ckpt["model"].items())  # the unwrapped model is saved


def test_resume_after_kill_9_equals_an_uninterrupted_run(shards, tmp_path):
    args = fast_cli_args(shards, epochs=6)
    straight = tmp_path / "straight"
    assert CliRunner().invoke(train_cli, args + ["--out", str(straight)]).exit_code == 0

    killed = tmp_path / "killed"
    done_before_kill = kill_9_after_first_checkpoint(args, killed)
    assert done_before_kill < 6, "the run finished before it could be killed"

    # TensorBoard reads event files in name order, and names start with the second they were opened in: a
    # resume within the killed writer's second (only in a test this fast) would be read before it
    killed_second = max(int(f.name.split(".")[3]) for f in (killed / "tensorboard").iterdir() if f.is_file())
    while int(time.time()) <= killed_second:
        time.sleep(0.05)
    resumed = CliRunner().invoke(train_cli, ["--resume", str(killed)])
    assert resumed.exit_code == 0, resumed.output
    assert f"starting at epoch {done_before_kill}" in resumed.output
    assert deterministic(metrics(killed)) == deterministic(metrics(straight))
    # TensorBoard shows each epoch once too: the replayed epochs' events from before the kill are purged
    assert tensorboard_scalars(killed, "top1") == [(r["epoch"], pytest.approx(r["top1"])) for r in metrics(straight)]
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(killed / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def kill_9_after_first_checkpoint(args: list[str], out: Path, timeout: float = 300) -> int:
    """dali-train `args` into `out` in a child process, killed with SIGKILL as soon as its first last.pt is on
    disk; the epochs that checkpoint holds."""
    command = [sys.executable, "-m", "dalifeed.train.cli", *args, "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (out / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return torch.load(out / "last.pt", weights_only=False)["state"]["epoch"]


class Killed(BaseException):
    """Stands in for a kill -9 right after a checkpoint reached the disk."""


def test_resume_mid_epoch_equals_an_uninterrupted_run(shards, tmp_path, monkeypatch):
    args = fast_cli_args(shards, epochs=3)
    straight = tmp_path / "straight"  # no --checkpoint-every: enabling DALI's checkpointing changes nothing
    assert CliRunner().invoke(train_cli, args + ["--out", str(straight)]).exit_code == 0

    real_save = checkpoint.save

    def save_then_die(path, state):
        real_save(path, state)
        if state.get("midway") and state["state"]["step"] == 7:  # epoch 1 (5 steps an epoch), 2 steps in
            raise Killed

    run = tmp_path / "run"
    with monkeypatch.context() as m, pytest.raises(Killed):  # a BaseException: nothing catches it, as with kill -9
        m.setattr(checkpoint, "save", save_then_die)
        CliRunner().invoke(train_cli, args + ["--out", str(run), "--checkpoint-every", "1"])
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["state"]["epoch"] == 1 and saved["midway"]["loaders"][0]["samples_done"] == 2 * 8  # 2 batches of 8
    assert [r["epoch"] for r in metrics(run)] == [0]

    other = tmp_path / "saved-by-two-ranks"  # one rank's reader state given as two ranks': samples twice
    shutil.copytree(run, other)
    two = dict(saved, midway={**saved["midway"], "loaders": saved["midway"]["loaders"] * 2})
    torch.save(two, other / "last.pt")
    refused = CliRunner().invoke(train_cli, ["--resume", str(other)])
    assert refused.exit_code == 2, refused.output
    assert ("saved mid-epoch by 2 processes and cannot be resumed on 1 (the ranks recorded 16 samples more than "
            "once") in refused.output

    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert "starting at epoch 1, batch 2 of 5" in resumed.output
    assert deterministic(metrics(run)) == deterministic(metrics(straight))
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(run / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "midway" not in torch.load(run / "last.pt", weights_only=False)  # the finished run ends on an epoch


def test_a_resumed_log_replays_epochs_without_writing_them_twice(tmp_path, monkeypatch):
    """A crash between an epoch's metrics line and its checkpoint replays that epoch on resume: its first
    metrics line and TensorBoard events must give way to the replay's."""
    log = RunLog(tmp_path, enabled=True, resume_epoch=None)
    for epoch in range(3):
        log.write({"epoch": epoch, "top1": 0.1 * epoch})
    log.close()
    # The resumed run is a later process: TensorBoard reads event files in name order, and a name is
    # <seconds>.<host>.<pid>.<writer count>, so two writers of one process in one second sort by their count
    # as text (writer 10 before writer 9), which only this test's timing could produce.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 60)
    log = RunLog(tmp_path, enabled=True, resume_epoch=1)  # last.pt says: epochs 0 done
    for epoch in (1, 2):
        log.write({"epoch": epoch, "top1": 0.5 + 0.1 * epoch})
    log.close()
    assert [(r["epoch"], r["top1"]) for r in metrics(tmp_path)] == [(0, 0.0), (1, 0.6), (2, 0.7)]
    assert tensorboard_scalars(tmp_path, "top1") == [(0, 0.0), (1, pytest.approx(0.6)), (2, pytest.approx(0.7))]


def _ddp_rank(rank: int, world: int, port: int, cfg: TrainConfig, results: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = train(cfg)
    torch.save({"weights": result.model.state_dict(), "metrics": result.metrics}, results / f"rank{rank}.pt")


@pytest.mark.slow
def test_two_rank_gloo_ddp_keeps_ranks_identical_and_counts_val_once(shards, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # per-rank batch 8 on 2 ranks: global batch 16; 45 samples -> 22 a rank -> 2 steps an epoch
    cfg = fast_config(shards, tmp_path / "ddp", epochs=3, workers=1, swa_start=1)  # SWA's BatchNorm pass too
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, cfg, tmp_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    w0, w1 = r0["weights"], r1["weights"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks diverged"
    # every validation image counted exactly once across the two ranks, the same numbers on both
    assert r0["metrics"]["val_samples"] == r1["metrics"]["val_samples"] == 21
    assert r0["metrics"]["top1"] == r1["metrics"]["top1"]
    assert r0["metrics"]["swa_top1"] == r1["metrics"]["swa_top1"]
    assert checkpoint.load(tmp_path / "ddp" / "swa.pt")["swa"]["epochs_averaged"] == 2
    records = metrics(tmp_path / "ddp")  # only rank 0 writes
    assert [r["epoch"] for r in records] == [0, 1, 2]
    saved = torch.load(tmp_path / "ddp" / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], w0[k]) for k in saved)  # the unwrapped model, no "module." prefix
    # the ranks agree on weights that training changed (6 steps are too few to assert on the loss: that is
    # test_short_training_learns_and_writes_its_outputs' job)
    torch.manual_seed(cfg.seed)
    initial = build_model("resnet18", 3).state_dict()
    assert not torch.equal(saved["fc.weight"], initial["fc.weight"])
    assert not torch.equal(saved["layer1.0.conv1.weight"], initial["layer1.0.conv1.weight"])


def real_batches(shards: Path, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = make_loader(shards, "train", batch, augment=AugmentConfig(image_size=8), train=False, device="cpu")
    return [(x.clone(), y.clone()) for x, y in loader][:2]


class Linear(torch.nn.Module):
    """No batch norm, no dropout: gradients of a sum over a batch are exactly the sum over micro-batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


def linear_run(batches, accum_steps: int = 1, clip: float | None = None, lr: float = 0.5, nesterov: bool = True) -> Run:
    """A Run of `Linear` on `batches` (a list stands in for the loader), SGD at a constant `lr`, on the CPU
    (fused, as dali-train's optimizer is: the loop skips a non-finite step through it)."""
    model = Linear()
    cfg = TrainConfig(data=".", out=".", accum_steps=accum_steps, clip_grad=clip, label_smoothing=0.0)
    optimizer = skips_on_device(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=nesterov,
                                                fused=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Run(cfg, Dist(0, 1, 0, torch.device("cpu")), model, optimizer, scheduler,
               torch.amp.GradScaler("cpu", enabled=False), train_loader=batches)


def one_epoch(batches, accum_steps: int, clip: float | None = None, lr: float = 0.5) -> torch.nn.Module:
    run = linear_run(batches, accum_steps, clip, lr)
    train_one_epoch(run)
    return run.model


@pytest.mark.kernels
def test_accumulating_2_batches_of_b_equals_one_batch_of_2b(shards):
    big = real_batches(shards, 8)  # real DALI batches replayed: the same data for both sides
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    a, b = one_epoch(big, accum_steps=1), one_epoch(halves, accum_steps=2)
    assert torch.allclose(a.fc.weight, b.fc.weight, atol=1e-6)
    no_accum = one_epoch(halves, accum_steps=1)  # twice the steps: must differ, or the test shows nothing
    assert not torch.allclose(a.fc.weight, no_accum.fc.weight, atol=1e-4)


@pytest.mark.kernels
def test_clip_grad_bounds_the_update(shards):
    batches = real_batches(shards, 8)[:1]
    start = Linear().fc.weight.detach().clone()
    clipped = one_epoch(batches, 1, clip=1e-3, lr=1.0).fc.weight.detach()
    free = one_epoch(batches, 1, clip=None, lr=1.0).fc.weight.detach()
    # first Nesterov step moves by lr * (1 + momentum) * g, with |g| <= clip once clipped
    assert (clipped - start).norm() <= 1.0 * 1.9 * 1e-3 + 1e-6
    assert (free - start).norm() > 10 * (clipped - start).norm()


def test_a_finite_loss_with_a_non_finite_gradient_is_not_applied(shards):
    batches = real_batches(shards, 8)[:1]
    run = linear_run(batches, nesterov=False)
    start = run.model.fc.weight.detach().clone()
    run.model.fc.weight.register_hook(lambda grad: grad * float("inf"))  # the loss stays finite, the gradient not
    stats = train_one_epoch(run)
    assert stats.bad_steps == 1 and torch.equal(run.model.fc.weight, start)
    assert run.state.step == 1 and run.state.bad_streak == 1  # the schedule still counts the step


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.kernels
def test_an_optimizer_saved_unfused_resumes_fused_and_skips_on_the_device(optimizer):
    """Checkpoints written before the optimizer was fused hold its state as torch's default (foreach)
    implementation keeps it: param groups saying fused False, AdamW's step counts on the CPU, and no SGD
    momentum buffer when the first step was skipped. Loaded into dali-train's optimizer, it must still skip a
    step on the device (weights and state unchanged) and otherwise step as the unfused one does."""
    cfg = TrainConfig(data=".", out=".", optimizer=optimizer, momentum=0.9, weight_decay=0.0)
    old_model, new_model = Linear(), Linear()
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    old = kind(param_groups(old_model, 0.0), lr=0.1,
               **({"momentum": 0.9, "nesterov": True} if optimizer == "sgd" else {}))
    if optimizer == "adamw":  # AdamW: one step taken, its count on the CPU
        old_model.fc.weight.grad = torch.ones_like(old_model.fc.weight)
        old_model.fc.bias.grad = torch.ones_like(old_model.fc.bias)
        old.step()
    # SGD: no step taken, no momentum buffer. Through a file, as a checkpoint comes: a state_dict shares its
    # tensors with the optimizer, and two optimizers stepping one step count would each count twice.
    buffer = io.BytesIO()
    torch.save(old.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert all(group["fused"] is not True for group in saved["param_groups"])
    new_model.load_state_dict(old_model.state_dict())
    fused = build_optimizer(cfg, new_model, lr=0.1)
    fused.load_state_dict(saved)
    skips_on_device(fused)

    before = {k: v.clone() for k, v in new_model.state_dict().items()}
    for p in new_model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    fused.found_inf = torch.ones(())
    fused.step()
    assert all(torch.equal(before[k], v) for k, v in new_model.state_dict().items())

    for a, b in zip(old_model.parameters(), new_model.parameters()):
        a.grad = torch.linspace(-1, 1, a.numel()).reshape(a.shape)
        b.grad = a.grad.clone()
    fused.found_inf = torch.zeros(())
    old.step()
    fused.step()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(old_model.parameters(), new_model.parameters()))
    assert not torch.equal(before["fc.weight"], new_model.fc.weight)


def test_amp_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert amp_dtype(TrainConfig(data=".", out=".", amp="auto"), cpu) is None
    assert amp_dtype(TrainConfig(data=".", out=".", amp="bf16"), cpu) is torch.bfloat16
    assert amp_dtype(TrainConfig(data=".", out=".", amp="fp16"), cuda) is torch.float16
    assert amp_dtype(TrainConfig(data=".", out=".", amp="off"), cuda) is None


@pytest.mark.parametrize("capability, dtype", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                               ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_amp_auto_takes_bf16_only_where_the_gpu_has_it(capability, dtype):
    """V100 (sm70) and T4 (sm75) emulate bf16, slower than fp16: auto takes fp16 (with its GradScaler) there,
    where torch.cuda.is_bf16_supported() would say yes (including_emulation=True by default)."""
    assert amp_dtype(TrainConfig(data=".", out=".", amp="auto"), torch.device("cuda"), capability) is dtype


def onednn_isa_at_most_avx2() -> str:
    """The ONEDNN_MAX_CPU_ISA for a bf16 run: AVX2, or the lower limit already set (make test-kernels' SSE4.1)."""
    current = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return current if current in ("SSE41", "AVX", "AVX2") else "AVX2"


@pytest.mark.kernels
def test_bf16_autocast_trains_on_the_cpu(shards, tmp_path):
    # oneDNN's AVX-512 bf16 kernels on this (virtual) CPU intermittently return NaN for the same model and
    # input: 0 to 234 of 300 bf16 forward/backward passes, run to run, and none with ONEDNN_MAX_CPU_ISA=AVX2
    # or in fp32 (see docs/training.md). The run gets its own process so that it can be pinned to AVX2 (or
    # below, when make test-kernels holds every test to SSE4.1).
    args = fast_cli_args(shards, epochs=2)
    run = subprocess.run([sys.executable, "-m", "dalifeed.train.cli", *args, "--amp", "bf16",
                          "--out", str(tmp_path / "bf16")], capture_output=True, text=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": onednn_isa_at_most_avx2()})
    assert run.returncode == 0, run.stderr[-2000:]
    bf16 = metrics(tmp_path / "bf16")[-1]
    assert torch.isfinite(torch.tensor(bf16["train_loss"])) and bf16["bad_steps"] == 0
    assert CliRunner().invoke(train_cli, args + ["--amp", "off", "--out", str(tmp_path / "fp32")]).exit_code == 0
    assert bf16["train_loss"] != metrics(tmp_path / "fp32")[-1]["train_loss"]  # bf16 really ran


def test_schedule_warms_up_then_decays_to_min():
    f = warmup_cosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55, abs=1e-6) and f(99) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.kernels
def test_non_finite_loss_skips_then_aborts(shards, tmp_path):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "nan"), "--model",
                                            "resnet18", "--image-size", "16", "--batch-size", "8", "--lr", "1e12",
                                            "--warmup-epochs", "0", "--epochs", "3", "--max-bad-steps", "2"])
    assert result.exit_code == 1
    # read at a check (not after every step): the run of skipped steps it found, at least --max-bad-steps
    diverged = re.search(r"training diverged: loss or gradients were not finite for (\d+) steps in a row by "
                         r"epoch 0 step (\d+) \(--max-bad-steps 2\)", result.output)
    assert diverged and 2 <= int(diverged[1]) <= int(diverged[2]), result.output
    assert not (tmp_path / "nan" / "last.pt").exists()  # stopped within epoch 0, before its checkpoint


CPU = Dist(0, 1, 0, torch.device("cpu"))


def test_pretrained_weights_load_and_a_different_head_is_replaced(tmp_path, capsys):
    import torchvision

    path = tmp_path / "r18-5classes.pt"
    torch.manual_seed(1)
    source = torchvision.models.resnet18(num_classes=5)
    torch.save(source.state_dict(), path)
    model, _ = make_model(TrainConfig(data=".", out=".", model="resnet18", pretrained=str(path)), CPU, 3)
    assert "--pretrained: re-initialised fc.weight, fc.bias (class count differs)" in capsys.readouterr().out
    weights = model.state_dict()
    assert weights["fc.weight"].shape == (3, 512)
    assert all(torch.equal(weights[k], v) for k, v in source.state_dict().items() if not k.startswith("fc."))


def test_pretrained_takes_dali_trains_own_last_and_best_checkpoints(shards, tmp_path, capsys):
    """docs/training.md: --pretrained runs/x/last.pt fine-tunes from a dali-train run. Its checkpoints hold RNG
    states besides the weights; they must load with torch.load(weights_only=True), and so must a checkpoint
    written before NumPy's state was stored as a tensor (np.random.get_state()'s ndarray)."""
    import numpy as np

    run = tmp_path / "run"
    train(fast_config(shards, run, epochs=1))
    saved = torch.load(run / "last.pt", weights_only=False)
    assert isinstance(saved["rng"]["numpy"]["keys"], torch.Tensor)
    old = tmp_path / "old.pt"
    torch.save({**saved, "rng": {**saved["rng"], "numpy": np.random.get_state()}}, old)
    capsys.readouterr()
    for path in (run / "last.pt", run / "best.pt", old):
        model, _ = make_model(fast_config(shards, tmp_path / "ft", pretrained=str(path)), CPU, 3)
        weights = torch.load(path, weights_only=False)["model"]
        assert ("re-initialised" not in capsys.readouterr().out
                and all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())), path
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "ft"),
                                            *fast_args(epochs=1), "--pretrained", str(run / "best.pt")])
    assert result.exit_code == 0, result.output


def test_no_compile_turns_off_on_resume_what_the_run_started_with(shards, tmp_path):
    """--compile may change on resume (it does not change the maths); --no-compile is how to turn it off
    under --resume RUN, where an option not typed keeps the saved value."""
    from dalifeed.train.resume import resolve_run

    run = tmp_path / "run"
    train(fast_config(shards, run, epochs=1))
    saved = torch.load(run / "last.pt", weights_only=False)
    saved["config"]["compile"] = True  # as if started with --compile
    torch.save(saved, run / "last.pt")
    kept, _ = resolve_run(fast_config(shards, run), typed=set(), resume=run)
    off, _ = resolve_run(fast_config(shards, run, compile=False), typed={"compile"}, resume=run)
    assert kept.compile is True and off.compile is False
    assert "--compile / --no-compile" in CliRunner().invoke(train_cli, ["--help"]).output


def test_cache_options_with_local_data_are_warned_about(shards, tmp_path):
    """--cache-dir and --cache-limit serve s3:// data only; given with a local folder they used to be ignored
    without a word."""
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), *fast_args(epochs=1),
                                            "--cache-dir", str(tmp_path / "cache"), "--cache-limit", "1GB"])
    assert result.exit_code == 0, result.output
    assert (f"warning: --cache-dir/--cache-limit apply to s3:// data only; {shards} is read in place"
            in result.output)
    assert not (tmp_path / "cache").exists()


def test_numpy_rng_state_round_trips_through_a_checkpoint():
    import numpy as np

    np.random.seed(3)
    np.random.normal()  # a cached Gaussian in the state
    state = checkpoint.rng_state()
    expected = np.random.random(5)
    np.random.seed(99)
    checkpoint.restore_rng(state)
    assert np.array_equal(np.random.random(5), expected)


@pytest.mark.parametrize("extra, message", [
    (["--model", "resnet9000"], "not a torchvision classification model"),
    (["--crop-scale", "0.9,0.1"], "--crop-scale must be MIN,MAX"),
    (["--crop-scale", "big"], "expected MIN,MAX"),
    (["--accum-steps", "0"], "--accum-steps must be >= 1"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--hw-decoder-load", "1.5"], "--hw-decoder-load must be in [0, 1]"),
    (["--lanes", "0"], "--lanes must be >= 1"),
])
def test_bad_flags_are_one_line_usage_errors(shards, tmp_path, extra, message):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "bad"), *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_checkpoint_problems_are_one_line_usage_errors(shards, tmp_path):
    run = tmp_path / "run"
    missing = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert missing.exit_code == 2 and "no checkpoint to resume from" in missing.output

    assert CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), "--model", "resnet18",
                                          "--image-size", "16", "--batch-size", "8", "--epochs", "1",
                                          "--warmup-epochs", "0"]).exit_code == 0
    again = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run)])
    assert again.exit_code == 2 and f"--resume {run}" in again.output

    changed = CliRunner().invoke(train_cli, ["--resume", str(run), "--model", "resnet34"])
    assert changed.exit_code == 2 and "--model resnet34 differs from the resumed run's 'resnet18'" in changed.output

    other = tmp_path / "other"
    write_imagefolder(other / "src", {"cat": 12, "dog": 12})
    convert_imagefolder(ConvertConfig(src=other / "src", out=other / "shards", val_fraction=0.25, progress=False))
    ckpt = torch.load(run / "last.pt", weights_only=False)
    ckpt["config"]["data"] = str(other / "shards")
    torch.save(ckpt, run / "last.pt")
    mismatch = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2"])
    assert mismatch.exit_code == 2 and "trained on other classes" in mismatch.output

    (run / "last.pt").write_bytes((run / "last.pt").read_bytes()[:1000])
    broken = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert broken.exit_code == 2 and "unreadable checkpoint" in broken.output


def test_width_narrows_a_resnet_and_is_refused_for_other_models(shards, tmp_path):
    from dalifeed.train.models import ModelError

    narrow, full = build_model("resnet18", 3, width=16), build_model("resnet18", 3)
    assert [narrow.conv1.out_channels, narrow.layer2[0].conv1.out_channels, narrow.layer4[1].conv2.out_channels,
            narrow.fc.in_features] == [16, 32, 128, 128]
    assert sum(p.numel() for p in full.parameters()) > 15 * sum(p.numel() for p in narrow.parameters())
    assert build_model("resnet50", 3, width=16).fc.in_features == 16 * 8 * 4  # bottlenecks expand by 4
    with pytest.raises(ModelError, match="plain ResNets"):
        build_model("resnext50_32x4d", 3, width=16)
    model, _ = make_model(fast_config(shards, tmp_path / "narrow", width=16), CPU, 3)  # what dali-train builds
    assert model.layer4[0].conv1.out_channels == 128
    refused = CliRunner().invoke(train_cli, fast_cli_args(shards, 1, model="mobilenet_v3_small", width=16)
                                 + ["--out", str(tmp_path / "mobile")])
    assert refused.exit_code == 2 and "--width applies to torchvision's plain ResNets" in refused.output


def test_a_checkpoint_that_calls_its_best_score_best_top1_resumes_and_keeps_it(shards, tmp_path):
    """Checkpoints written before the score best.pt keeps was named best_score held it as best_top1."""
    run = tmp_path / "run"
    train(fast_config(shards, run, epochs=1))
    saved = torch.load(run / "last.pt", weights_only=False)
    saved["state"] = {"epoch": 1, "step": saved["state"]["step"], "best_top1": 2.0, "bad_streak": 0}  # 2: unbeatable
    torch.save(saved, run / "last.pt")
    best = (run / "best.pt").read_bytes()
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2"])
    assert resumed.exit_code == 0, resumed.output
    assert [r["epoch"] for r in metrics(run)] == [0, 1]
    assert torch.load(run / "last.pt", weights_only=False)["state"]["best_score"] == 2.0
    assert (run / "best.pt").read_bytes() == best  # epoch 1 did not beat the saved best


@pytest.mark.parametrize("task, val_split, score", [("classify", "val", 0.75), ("multilabel", "val", 0.5),
                                                    ("classify", None, -1.25), ("multilabel", None, -1.25)])
def test_the_score_best_pt_keeps_is_top1_map_or_minus_the_train_loss(task, val_split, score):
    record = {"train_loss": 1.25, "top1": 0.75, "map": 0.5} if val_split else {"train_loss": 1.25}
    if task == "classify" and val_split:
        del record["map"]
    if task == "multilabel" and val_split:
        del record["top1"]
    assert epoch_score(TrainConfig(data=".", out=".", task=task, val_split=val_split), record) == score


def test_lanes_are_an_option_the_run_records_and_says(shards, tmp_path):
    """--lanes 2: the training loader reads in two pipelines of half --dali-threads each; config.json records
    it, the first lines say it. The default (these epochs are short: one lane) says nothing."""
    run = tmp_path / "lanes"
    result = CliRunner().invoke(train_cli, [*fast_cli_args(shards, 1, lanes=2), "--out", str(run)])
    assert result.exit_code == 0, result.output
    assert "training loader: 2 lanes of 1 DALI thread(s) each" in result.output
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["lanes"] == 2 and recorded["loaders"]["train"]["lanes"] == 2
    default = CliRunner().invoke(train_cli, [*fast_cli_args(shards, 1), "--out", str(tmp_path / "default")])
    assert default.exit_code == 0 and "lanes of" not in default.output, default.output


def test_main_resume_auto_continues_the_run_its_folder_holds(shards, tmp_path):
    """`main(cfg, resume="auto")` is `dali-train --resume auto` from Python: a folder without last.pt starts the
    run, one with it continues the run (here with more epochs, an option a resume may change)."""
    run = tmp_path / "run"
    train(fast_config(shards, run, epochs=1), resume="auto")
    train(fast_config(shards, run, epochs=2), resume="auto")
    assert [r["epoch"] for r in metrics(run)] == [0, 1]


def test_evaluate_takes_a_plain_device_and_counts_every_sample():
    """`evaluate` from a loop of one's own: a device instead of dali-train's process record, any iterable of
    batches; the figures checked against a hand count."""
    from dalifeed.train import evaluate

    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [1.0, 0.0, 3.0]])
    labels = torch.tensor([0, 2, 2, 1, 2])
    model = torch.nn.Identity()
    batches = [(logits[:2], labels[:2]), (logits[2:], labels[2:])]  # 5 samples: a short last batch
    got = evaluate(model, batches, "cpu", num_classes=3)
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert got["val_samples"] == 5 and got["top1"] == pytest.approx(3 / 5) and got["top5"] == 1.0
    assert got["val_loss"] == pytest.approx(expected_loss)
