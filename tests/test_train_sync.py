"""A training step never makes the host wait for the device: the host syncs of an epoch are counted by the
optimizer step they happen in, and only the checks (the epoch's first step, then about every CHECK_SECONDS,
and its end) may have one.

The count is of the calls that read a tensor's value on the host, which on a GPU wait for every kernel queued
before them: `Tensor.item`, `.tolist`, `.cpu`, `.numpy`, `bool()`/`float()`/`int()`/`index()` of a tensor, and
`torch.cuda.synchronize`. Counting wrappers around them (the real functions still run) see every such call
our code or the torch code it calls makes from Python; on the CPU a read costs nothing, but it is the same
call that stalls a GPU. What they cannot see is a read inside a C++ operator: on the CPU `F.one_hot` checks its
labels with one, on CUDA it does not (aten/src/ATen/native/Onehot.cpp leaves that check to the device)."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from dalifeed.train import stop
from dalifeed.train.distributed import Dist
from dalifeed.train.trainer import build_run, train_one_epoch

from fast_recipe import fast_config

TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """45 train images: 5 optimizer steps of 8 an epoch."""
    return make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=10)[1]


def count_syncs(monkeypatch, run) -> list[tuple[int, str, str]]:
    """From now on, every host read: (optimizer steps done when it happened, what, where in dalifeed)."""
    calls = []

    def counting(original, name):
        def wrapper(*args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if "/dalifeed/" in f.filename]
            if frames and frames[-1].name == "host_sources":  # a CPU tensor on every device (its docstring)
                return original(*args, **kwargs)
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            calls.append((run.state.step, name, where))
            return original(*args, **kwargs)
        return wrapper

    for name in TENSOR_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch.cuda, "synchronize", counting(torch.cuda.synchronize, "cuda.synchronize"))
    return calls


@pytest.mark.parametrize("amp", ["bf16", "fp16", "off"])
def test_no_host_sync_between_checks(shards, tmp_path, monkeypatch, amp):
    """With mixup/cutmix, --clip-grad, --ema and channels-last on, the paths a step can take: only the check
    after the first step (one read: its all-reduced tallies) and the epoch's end (the check's read and the
    loss sum's) read the device. fp16 too: the GradScaler hands its verdict to the fused optimizer on the
    device instead of reading it (torch/amp/grad_scaler.py, `_step_supports_amp_scaling`)."""
    monkeypatch.setattr(stop, "CHECK_SECONDS", 1e9)  # no timed check inside this short epoch: only the fixed ones
    cfg = fast_config(shards, tmp_path / "run", width=8, amp=amp, ema=0.9, clip_grad=1.0, mixup_alpha=0.2,
                      cutmix_alpha=1.0, channels_last=True, progress_every=0, tensorboard_every=0,
                      max_bad_steps=10**6)  # a skipped step is one of the paths: it must not sync either
    cfg.validate()
    Path(cfg.out).mkdir()
    run = build_run(cfg, Dist(0, 1, 0, torch.device("cpu")), resume=None)
    run.start_epoch(0)
    with monkeypatch.context() as m:
        calls = count_syncs(m, run)
        stats = train_one_epoch(run)
    assert stats.steps == 5
    per_step = Counter(step for step, _, _ in calls)
    assert {step: per_step[step] for step in range(6)} == {0: 0, 1: 1, 2: 0, 3: 0, 4: 0, 5: 2}, calls
    assert sorted(name for _, name, _ in calls) == ["tolist"] * 3, calls


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
