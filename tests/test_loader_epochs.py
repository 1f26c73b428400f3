"""What a training loader holds built at an epoch's boundary, during validation and at the end of the run: the
next epoch's pipelines started ahead (docs/gpu.md, "A pipeline per epoch"), but none past the run's last epoch
(`LoaderOptions.epochs`), and none after a pass over one epoch alone (`set_epoch(..., ahead=False)`: SWA's
BatchNorm pass)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset
from dalifeed.train.distributed import Dist
from dalifeed.train.swa import update_bn
from helpers import one_image_classes
from test_loader import built_pipelines, labels_of

N = 53  # prime: 13 batches of 4 a training epoch


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return one_image_classes(tmp_path_factory.mktemp("epochs"), N, seed=1, prefix="e", samples_per_shard=7)


def train_loader(shards: Path, **options):
    return make_loader(shards, "train", 4, augment=AugmentConfig(image_size=16), seed=4, device="cpu",
                       num_threads=2, **options)


def val_loader(shards: Path):
    return make_loader(shards, "train", 5, augment=AugmentConfig(image_size=16), train=False, device="cpu")


def epoch_counts(loader, at: set[int] | None = None) -> dict[int, int]:
    """The pipelines built in this process when batch i of one epoch of `loader` is handed out, for each i in
    `at` (default: the first and the last; a count collects the garbage, which takes a while)."""
    at = {0, len(loader) - 1} if at is None else at
    return {i: len(built_pipelines()) for i, _ in enumerate(loader) if i in at}


@pytest.mark.parametrize("lanes", [1, 2])
def test_the_last_epoch_starts_nothing_ahead_and_validation_runs_beside_the_next_epoch_only_before_it(shards,
                                                                                                      lanes):
    """A run of 2 epochs: epoch 0's end holds epoch 1's pipelines started (one per lane) while validation runs;
    epoch 1, the last, holds only its own to its end, and validation after it runs alone; at the end of the
    run nothing is built. Epoch 1 read from the pipelines started ahead is epoch 1 as a fresh loader reads it."""
    train, val = train_loader(shards, lanes=lanes, epochs=2), val_loader(shards)
    ahead = lanes * train.options.prefetch_queue_depth + 1  # the batches handed out with epoch 1's started
    edge = len(train) - ahead  # the first batch handed out with them
    assert epoch_counts(train, {0, edge - 1, edge, len(train) - 1}) == {0: lanes, edge - 1: lanes, edge: 2 * lanes,
                                                                         len(train) - 1: 2 * lanes}
    assert train._next is not None and train._next[0] == 1
    assert set(epoch_counts(val).values()) == {1 + lanes}  # validation's and epoch 1's, started
    fresh = train_loader(shards, lanes=lanes)
    fresh.set_epoch(1)
    expected = labels_of(fresh)
    del fresh
    got = []
    for i, (_, labels) in enumerate(train):  # the last epoch: its own pipelines only, to its last batch
        got.append(labels.tolist())
        assert i < len(train) - 1 or len(built_pipelines()) == lanes
    assert got == expected
    assert train._next is None and train.definitions.ahead is None  # not even defined ahead
    assert built_pipelines() == []
    assert set(epoch_counts(val).values()) == {1}  # validation alone
    assert built_pipelines() == []


def test_a_pass_over_one_epoch_alone_starts_nothing_ahead(shards):
    """`set_epoch(e, ahead=False)` on a loader that does not know the run's end (SWA's BatchNorm pass, an
    evaluation over training data): the epoch's own pipeline only, nothing left after it; a later
    `set_epoch(e)` starts ahead again."""
    train = train_loader(shards, lanes=1)
    train.set_epoch(3, ahead=False)
    assert set(epoch_counts(train).values()) == {1}
    assert train._next is None and built_pipelines() == []
    train.set_epoch(3)
    assert epoch_counts(train)[len(train) - 1] == 2 and train._next[0] == 4


def test_swa_update_bn_after_the_last_epoch_builds_that_epoch_alone(shards):
    """dali-train's end with --swa-start: the last epoch (started ahead by the one before), then the
    BatchNorm pass over it again: during the pass, that epoch's pipeline only (not the one after it, dropped
    and rebuilt), nothing after."""
    train = train_loader(shards, lanes=1, epochs=2)
    train.set_epoch(1)
    for _ in train:
        pass
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    seen, counts = [], []

    def count(*_):  # at the pass's first and last batch (the next epoch would have started by then)
        seen.append(1)
        if len(seen) in (1, len(train)):
            counts.append(len(built_pipelines()))

    model.register_forward_pre_hook(count)
    batches = update_bn(model, train, Dist(0, 1, 0, torch.device("cpu")), None, False, epoch=1)
    assert batches == len(train) and counts == [1, 1]
    assert built_pipelines() == []


def test_a_mixed_loader_starts_nothing_past_the_run(shards, tmp_path):
    """Several datasets mixed: each dataset's loader is told the run's end in its own epochs (a mixed epoch
    reads several of a small dataset's), so the last mixed epoch leaves nothing started."""
    small = one_image_classes(tmp_path / "small", 11, seed=2, prefix="e", samples_per_shard=4)
    loader = make_loader(open_dataset([shards, small], weights=[3, 1]), "train", 4,
                         augment=AugmentConfig(image_size=16), seed=4, device="cpu", num_threads=2, lanes=1, epochs=2)
    for _epoch in range(2):
        for _ in loader:
            pass
    assert built_pipelines() == []
