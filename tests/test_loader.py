"""make_loader's epoch contract, checked with one image per class so a label names its sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dalifeed.pipelines import make_loader
from dalifeed.tools import ConvertConfig, convert_imagefolder

N = 37  # prime: divisible by no batch size or world size used here


@pytest.fixture(scope="module")
def unique_shards(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("unique")
    rng = np.random.default_rng(0)
    for i in range(N):
        folder = tmp / "src" / f"s{i:02d}"
        folder.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(folder / "x.jpg")
    convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "shards", samples_per_shard=6, progress=False))
    return tmp / "shards"


def labels_of(loader) -> list[list[int]]:
    return [labels.tolist() for _, labels in loader]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch", [4, 5])
def test_validation_sees_every_sample_exactly_once_across_ranks(unique_shards, world_size, batch):
    seen = []
    for rank in range(world_size):
        loader = make_loader(unique_shards, "train", batch, train=False, rank=rank, world_size=world_size,
                             image_size=16, device="cpu")
        for epoch in range(2):  # the second epoch builds its pipeline again: same contract
            batches = labels_of(loader)
            assert len(batches) == len(loader)
            assert sum(map(len, batches)) == loader.num_samples
            assert all(len(b) == batch for b in batches[:-1]) and 0 < len(batches[-1]) <= batch
            if epoch == 0:
                seen += [label for b in batches for label in b]
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_gives_every_rank_the_same_number_of_full_batches(unique_shards, world_size):
    batch = 4
    expected = (N // world_size) // batch
    per_rank = []
    for rank in range(world_size):
        loader = make_loader(unique_shards, "train", batch, rank=rank, world_size=world_size, image_size=16,
                             device="cpu", seed=5)
        assert len(loader) == expected
        for epoch in range(3):
            batches = labels_of(loader)
            assert len(batches) == expected and all(len(b) == batch for b in batches)
            flat = [label for b in batches for label in b]
            assert len(set(flat)) == len(flat)  # no duplicates (padding) inside an epoch
        per_rank.append(flat)
    if world_size > 1:
        assert not set(per_rank[0]) & set(per_rank[1])  # ranks read disjoint slices in the same epoch


def epoch_orders(shards, seed, epochs=2):
    loader = make_loader(shards, "train", 4, image_size=16, device="cpu", seed=seed)
    return [sum(labels_of(loader), []) for _ in range(epochs)]


def test_same_seed_same_order_and_different_seed_different_order(unique_shards):
    a, b, c = epoch_orders(unique_shards, 0), epoch_orders(unique_shards, 0), epoch_orders(unique_shards, 1)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # reshuffled between epochs
    assert a[0] != sorted(a[0])


def test_set_epoch_replays_an_epoch_exactly(unique_shards):
    """What a resumed trainer relies on: epoch e's samples and augmentations depend only on (seed, e)."""
    straight = make_loader(unique_shards, "train", 4, image_size=16, device="cpu", seed=9)
    for _ in range(2):
        list(straight)
    third = [(x.clone(), y.clone()) for x, y in straight]

    resumed = make_loader(unique_shards, "train", 4, image_size=16, device="cpu", seed=9)
    resumed.set_epoch(2)
    replay = list(resumed)
    assert len(third) == len(replay)
    for (x1, y1), (x2, y2) in zip(third, replay):
        assert torch.equal(y1, y2) and torch.equal(x1, x2)


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_a_loader_restored_mid_epoch_yields_exactly_the_rest_of_it(unique_shards, rank, world_size):
    def loader():
        return make_loader(unique_shards, "train", 4, rank=rank, world_size=world_size, seed=3, image_size=16,
                           device="cpu", checkpointing=True)

    straight = loader()
    epoch0 = [(images.clone(), labels.clone()) for images, labels in straight]
    epoch1 = [labels.tolist() for _, labels in straight]

    first = loader()
    batches = iter(first)
    for _ in range(2):
        next(batches)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["batches_done"] == 2 and state["dali"]
    del batches, first

    resumed = loader()
    resumed.load_state_dict(state)
    rest = [(images.clone(), labels.clone()) for images, labels in resumed]
    assert len(rest) == len(epoch0) - 2  # the rank with a spare batch still drops it
    for (a_images, a_labels), (b_images, b_labels) in zip(rest, epoch0[2:]):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)  # same samples, same crops
    assert [labels.tolist() for _, labels in resumed] == epoch1  # and the next epoch is the usual one
    assert resumed.state_dict() == {"epoch": 2, "batches_done": 0, "dali": None}


def test_a_mid_epoch_state_needs_checkpointing(unique_shards):
    loader = make_loader(unique_shards, "train", 4, image_size=16, device="cpu")
    batches = iter(loader)
    next(batches)
    with pytest.raises(RuntimeError, match="checkpointing=True"):
        loader.state_dict()
