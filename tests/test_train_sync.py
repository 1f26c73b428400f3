"""A training step never makes the host wait for the device: the host syncs of a run are counted by the
optimizer step they happen in, and only the checks (an epoch's first step, then about every CHECK_SECONDS,
and its end) may have one.

Reads are counted at two levels, because a GPU waits for both:

- In Python: the calls that read a tensor's value on the host, `Tensor.item`, `.tolist`, `.cpu`, `.numpy`,
  `bool()`/`float()`/`int()`/`index()` of a tensor, and `torch.cuda.synchronize`. Counting wrappers around
  them (the real functions still run) see every such call our code or the torch code it calls makes from
  Python.
- Below Python, where torch's own C++ reads a value: every `aten._local_scalar_dense` (what `.item()` is in
  C++, and what an operator's Scalar argument given a tensor costs: `_foreach_lerp_` with a tensor weight
  did that once a step) and every copy from another device to the CPU (`_to_copy`, `copy_`), seen by a
  `TorchDispatchMode` around the steps.

On the CPU a read costs nothing, but it is the same call that stalls a GPU. What neither sees is a read a CPU
kernel makes where its CUDA kernel does not (on the CPU `F.one_hot` checks its labels with one; dalifeed's
steps do not call it).

The count runs on one process and on two (a gloo group on the CPU: DDP's gradient buckets and buffer
broadcasts, the skip-step all-reduce), with --ema, --swa-start and mixup, and over SWA's BatchNorm pass.

What neither count sees, nor torch's `set_sync_debug_mode` on a GPU (tests/test_gpu.py), which checks only
torch's own synchronizing copies and stream waits (c10/cuda/CUDAFunctions.h, `memcpy_and_sync`,
`stream_synchronize`) and by its docstring not torch.distributed: DALI's host waits for its pipelines' outputs
(DALI's own C++ and CUDA calls), cuDNN benchmark's timing of algorithms for each new shape (`cudnn.benchmark`,
on in dali-train), and NCCL's collectives and their waits. Nor does a CPU count see DDP's one bucket rebuild
(its first forward after a synchronized backward): its copy of the broadcast indices back to the host
(torch/csrc/distributed/c10d/reducer.cpp, `sync_bucket_indices`, non_blocking=false) is a CPU copy on gloo,
and one device read a run on NCCL, which tests/test_gpu.py lets through."""

from __future__ import annotations

import copy
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.train import stop
from dalifeed.train.distributed import Dist
from dalifeed.train.swa import update_bn
from dalifeed.train.trainer import build_run, train_one_epoch, update_ema
from fast_recipe import fast_config
from helpers import run_ranks

TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# Functions that read a tensor known to be on the host, whatever the device (their docstrings say why)
HOST_READERS = ("host_sources", "read_host_copy")


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """200 train images: 25 batches of 8 an epoch, 12 optimizer steps with --accum-steps 2."""
    return make_shards({"train": {"red": 70, "green": 66, "blue": 64}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=40)[1]


class DispatchReads(TorchDispatchMode):
    """Every device read torch makes below Python while active (module docstring), as (optimizer steps done,
    operator) in `calls` (steps None without a `run`)."""

    def __init__(self, run=None):
        super().__init__()
        self.run, self.calls = run, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_device_read(func, args, kwargs):
            self.calls.append((self.run.state.step if self.run is not None else None, str(func)))
        return func(*args, **kwargs)


def is_device_read(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in ("aten::_local_scalar_dense", "aten::item"):
        return True
    if name == "aten::_to_copy":  # to the CPU from another device (a dtype cast on one device is no read)
        return str(kwargs.get("device")) == "cpu" and args[0].device.type != "cpu"
    if name == "aten::copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def count_syncs(monkeypatch, run) -> list[tuple[int, str, str]]:
    """From now on, every host read: (optimizer steps done when it happened, what, where in dalifeed)."""
    calls = []

    def counting(original, name):
        def wrapper(*args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if "/dalifeed/" in f.filename]
            if frames and frames[-1].name in HOST_READERS:
                return original(*args, **kwargs)
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            calls.append((run.state.step, name, where))
            return original(*args, **kwargs)
        return wrapper

    for name in TENSOR_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch.cuda, "synchronize", counting(torch.cuda.synchronize, "cuda.synchronize"))
    return calls


def sync_config(shards: Path, out: Path, amp: str, mixing: bool):
    """Every option that runs per step on (--ema, --clip-grad, --accum-steps, channels-last, label smoothing,
    --swa-start with --swa-lr's per-step schedule; mixup/cutmix's soft targets, or the hard labels' loss),
    progress lines and TensorBoard points at every step, 2 epochs."""
    cfg = fast_config(shards, out, width=8, amp=amp, ema=0.9, clip_grad=1.0,
                      mixup_alpha=0.2 if mixing else 0.0, cutmix_alpha=1.0 if mixing else 0.0, channels_last=True,
                      label_smoothing=0.1, accum_steps=2, progress_every=1e-6, tensorboard_every=1,
                      max_bad_steps=10**6,  # a skipped step is one of the paths: it must not sync either
                      epochs=2, swa_start=1, swa_lr=0.01, swa_anneal_epochs=0.5)
    cfg.validate()
    out.mkdir()
    return cfg


def count_run(run, patcher, bn_pass: bool = True) -> tuple[list, list, list[int]]:
    """The reads in Python (`count_syncs`) and below it (`DispatchReads`) of `run`'s epochs, then (`bn_pass`)
    of SWA's BatchNorm pass over the last; and the optimizer steps each epoch took. `patcher`: a
    `pytest.MonkeyPatch`."""
    below, steps = DispatchReads(run), []
    patcher.setattr(stop, "CHECK_SECONDS", 1e9)  # no timed check inside these short epochs: only the fixed ones
    with patcher.context() as m:
        calls = count_syncs(m, run)
        for epoch in range(run.cfg.epochs):
            run.state.epoch = epoch
            run.start_epoch(epoch)
            with below:
                steps.append(train_one_epoch(run).steps)
        if bn_pass:
            with below:
                batches = update_bn(run.swa.module, run.train_loader, run.dist, run.dtype, run.cfg.channels_last,
                                    run.cfg.epochs - 1)
            assert batches == len(run.train_loader)
    return calls, below.calls, steps


@pytest.mark.parametrize("mixing", [True, False], ids=["mixup-cutmix", "hard-labels"])
@pytest.mark.parametrize("amp", ["bf16", "fp16", "off"])
def test_no_host_sync_between_checks(shards, tmp_path, monkeypatch, amp, mixing):
    """Two epochs of 12 optimizer steps with every option that runs per step on (`sync_config`), then (once
    per precision) SWA's BatchNorm pass: only the check after each epoch's first step (one read: its
    all-reduced tallies) and each epoch's end (the check's read and the loss sum's) read the device, in
    Python; below Python, nothing does, the BatchNorm pass included.
    fp16 too: the GradScaler hands its verdict to the fused optimizer on the device instead of reading it
    (torch/amp/grad_scaler.py, `_step_supports_amp_scaling`)."""
    cfg = sync_config(shards, tmp_path / "run", amp, mixing)
    run = build_run(cfg, Dist(0, 1, 0, torch.device("cpu")), resume=None)
    calls, below, steps = count_run(run, monkeypatch, bn_pass=mixing)
    assert steps == [12, 12] and below == []
    per_step = Counter(step for step, _, _ in calls)
    assert dict(per_step) == {1: 1, 12: 2, 13: 1, 24: 2}, calls
    assert sorted(name for _, name, _ in calls) == ["tolist"] * 6, calls


def _count_on_rank(rank: int, port: int, cfg, results: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run = build_run(cfg, Dist(rank, 2, rank, torch.device("cpu")), resume=None)
        patcher = pytest.MonkeyPatch()
        try:
            counted = count_run(run, patcher)
        finally:
            patcher.undo()
        torch.save(counted, results / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_no_host_sync_between_checks_on_two_ranks(shards, tmp_path):
    """The same count on 2 processes of a gloo group on the CPU, with fp16, mixup and cutmix: DDP (its gradient
    buckets, each forward's buffer broadcast, `no_sync` in the accumulation window), the skip-step all-reduce
    (`stop.agree_to_skip`), the checks' all-reduced tallies, the EMA, and SWA's BatchNorm pass with its
    all-reduce of the statistics. Each rank: 6 optimizer steps an epoch (100 images in batches of 8, 2 a step),
    the same reads as on one process, at the same places."""
    cfg = sync_config(shards, tmp_path / "run", "fp16", mixing=True)
    run_ranks(_count_on_rank, cfg, tmp_path)
    for rank in range(2):
        calls, below, steps = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert steps == [6, 6] and below == []
        assert dict(Counter(step for step, _, _ in calls)) == {1: 1, 6: 2, 7: 1, 12: 2}, calls
        assert sorted(name for _, name, _ in calls) == ["tolist"] * 6, calls


def test_update_bn_is_torchs_and_reads_nothing_on_the_host(shards):
    """swa.update_bn over a DALI loader against torch.optim.swa_utils.update_bn over the same batches: the same
    running statistics and counts, bit for bit (each batch's factor is the same Python float 1/(k+1) handed to
    the same batch_norm kernel), the momenta and the mode restored; and no device read, where torch's
    `momentum=None` reads `num_batches_tracked` on the host in every BatchNorm forward
    (torch/nn/modules/batchnorm.py, `1.0 / float(self.num_batches_tracked)`)."""
    from torch.optim.swa_utils import update_bn as torchs_update_bn

    loader = make_loader(shards, "train", 8, augment=AugmentConfig(image_size=16), seed=1, device="cpu", epochs=3)
    loader.set_epoch(2)
    batches = [images.clone() for images, _ in loader]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 5, 3), torch.nn.BatchNorm2d(5, momentum=0.3),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.BatchNorm1d(5)).eval()
    ours = copy.deepcopy(model)
    torchs_update_bn(batches, model)
    below = DispatchReads()
    with below:
        assert update_bn(ours, loader, Dist(0, 1, 0, torch.device("cpu")), None, False, epoch=2) == len(batches)
    assert below.calls == []
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ours.buffers(), strict=True))
    assert int(ours[1].num_batches_tracked) == len(batches) == 25
    assert [m.momentum for m in (ours[1], ours[4], ours[7])] == [0.1, 0.3, 0.1] and not ours.training


@pytest.mark.kernels
def test_update_ema_is_torchs_ema_and_reads_nothing_on_the_host():
    """update_ema against torch's own EMA (`AveragedModel` with `get_ema_multi_avg_fn`, which takes the
    weights on its first update): the same averages, the first update an exact copy, a skipped step (taken
    0.0) leaving the average as it was; and no device read, where `_foreach_lerp_` with a tensor weight read
    it in C++ once an update."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.randn(2, 3, 6, 6))
    ours = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ours.n_averaged = ours.n_averaged.to(torch.device("cpu"))
    torchs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_device_read(func, args, kwargs or {}):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    for step, taken in enumerate([1.0, 1.0, 0.0, 1.0, 1.0]):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(2, 3, 6, 6))  # BatchNorm's running statistics move too
        with Reads():
            update_ema(ours, model, 0.9, taken=torch.tensor(taken))
        if taken:
            torchs.update_parameters(model)
        for a, b in zip(chain_state(ours), chain_state(torchs)):
            if step == 0:
                assert torch.equal(a, b)
            else:
                # torch's lerp and our multiply-add round apart by a few ulps of the operands (magnitude ~1),
                # not of the result, and by kernel family; a wrong weight is off by ~0.1.
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert int(ours.n_averaged) == int(torchs.n_averaged) == 4
    assert reads == []


def chain_state(averaged) -> list[torch.Tensor]:
    return [*averaged.module.parameters(), *averaged.module.buffers()]


def test_a_check_is_due_every_check_seconds_of_steps(monkeypatch):
    """The interval a check sets: CHECK_SECONDS of steps at the pace since the previous check (the slowest
    rank's: test_elastic.py has the ranks agree), at least 1 step and at most MAX_STEPS_BETWEEN_CHECKS; and the
    first step of every epoch is checked."""
    monkeypatch.setattr(stop, "CHECK_SECONDS", 4.0)
    clock = iter([100.0, 101.0, 101.0, 201.0, 201.0, 201.001, 201.001])  # time.perf_counter's answers in turn
    monkeypatch.setattr(stop.time, "perf_counter", lambda: next(clock))
    checks = stop.StepChecks.__new__(stop.StepChecks)
    checks.device, checks.every = torch.device("cpu"), 1
    checks.start_epoch(streak=0, step=10)  # at 100 s
    assert [checks.due(s) for s in (10, 11)] == [False, True]
    checks.read(stop.Stop(), step=11)  # 1 s for 1 step: the next check 4 steps on
    assert checks.every == 4 and [checks.due(s) for s in (14, 15)] == [False, True]
    checks.read(stop.Stop(), step=13)  # 100 s for 2 steps: a check after every step
    assert checks.every == 1 and checks.due(14)
    checks.read(stop.Stop(), step=14)  # 1 ms for a step: capped
    assert checks.every == stop.MAX_STEPS_BETWEEN_CHECKS
