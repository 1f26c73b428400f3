"""Lanes (dalifeed/pipelines/lanes.py): one rank's epoch read by two pipelines keeps the epoch contract of one:
the same `len`, every sample of the rank's shard at most once (validation: exactly once across ranks), a
mid-epoch state that resumes exactly, and a resume on another number of ranks that reads the rest once.
Every label of these shards names its sample (one image per class)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.pipelines import loader as loader_module
from dalifeed.pipelines.elastic import merge_rank_states
from dalifeed.pipelines.lanes import join_rows, lane_sizes, next_lane
from dalifeed.pipelines.loader import LANES_MIN_BATCHES, LoaderOptions, default_lanes
from helpers import one_image_classes

N = 37  # prime: lanes of 18 and 19 samples, whose whole batches of 4 (4 + 4) leave the 9th batch to be joined
OPTIONS = dict(device="cpu", augment=AugmentConfig(image_size=16), seed=3, initial_fill=8, num_threads=2, lanes=2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return one_image_classes(tmp_path_factory.mktemp("lanes"), N, seed=4, prefix="l", samples_per_shard=5)


@pytest.mark.parametrize("total, world, lanes", [(37, 1, 2), (37, 3, 2), (1000, 8, 3), (5, 2, 2), (96, 4, 4)])
def test_a_ranks_lanes_read_exactly_its_shard(total, world, lanes):
    for rank in range(world):
        sizes = lane_sizes(total, rank, world, lanes)
        assert sum(sizes) == len(range(total * rank // world, total * (rank + 1) // world))
        assert max(sizes) - min(sizes) <= 1


def test_lanes_take_turns_and_the_order_follows_from_the_counts():
    handed, whole, order = [0, 0], [3, 2], []
    while (lane := next_lane(handed, whole)) is not None:
        order.append(lane)
        handed[lane] += 1
    assert order == [0, 1, 0, 1, 0]
    assert next_lane([2, 1], [3, 2]) == 1  # a restored state continues where the counts say


def test_joined_rows_pad_what_differs_after_the_first_dimension():
    a, b = torch.ones(2, 3, dtype=torch.uint8), torch.full((1, 5), 2, dtype=torch.uint8)
    joined = join_rows([a, b])
    assert joined.shape == (3, 5) and joined[:2, 3:].eq(0).all() and joined[2].eq(2).all()


def test_two_lanes_only_where_they_pay():
    options = LoaderOptions("train", 64, device="cpu", num_threads=2).resolved()
    assert default_lanes(options, LANES_MIN_BATCHES) == 2
    assert default_lanes(options, LANES_MIN_BATCHES - 1) == 1  # the demo's 22-batch training epochs
    assert default_lanes(LoaderOptions("val", 64, device="cpu", num_threads=2).resolved(), 10**4) == 1
    assert default_lanes(LoaderOptions("train", 64, device="cpu", num_threads=1).resolved(), 10**4) == 1


def labels_of(batches) -> list[int]:
    return [int(x) for _, y in batches for x in y]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_in_two_lanes_hands_out_full_batches_of_the_ranks_shard_once(shards, world):
    """Two lanes read the rank's shard of one (the same tar order: a function of seed and epoch), whole batches
    of it, each sample at most once, and ranks stay disjoint."""
    batch = 4
    one = [make_loader(shards, "train", batch, rank=r, world_size=world, **{**OPTIONS, "lanes": 1})
           for r in range(world)]
    two = [make_loader(shards, "train", batch, rank=r, world_size=world, **OPTIONS) for r in range(world)]
    for _ in range(2):
        epoch = []
        for rank in range(world):
            assert len(two[rank]) == len(one[rank]) == (N // world) // batch
            batches = list(two[rank])
            assert len(batches) == len(two[rank]) and all(len(y) == batch for _, y in batches)
            seen, alone = labels_of(batches), labels_of(list(one[rank]))
            assert len(set(seen)) == len(seen)
            shard = N * (rank + 1) // world - N * rank // world
            assert len(set(seen) | set(alone)) <= shard  # both read the same shard
            epoch += seen
        assert len(set(epoch)) == len(epoch)  # ranks disjoint


@pytest.mark.parametrize("world, batch", [(1, 4), (2, 5), (3, 4)])
def test_validation_in_two_lanes_reads_every_sample_once_across_ranks(shards, world, batch):
    seen = []
    for rank in range(world):
        loader = make_loader(shards, "train", batch, rank=rank, world_size=world, train=False, **OPTIONS)
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(len(y) == batch for _, y in batches[:-1])
        seen += labels_of(batches)
    assert sorted(seen) == list(range(N))


def test_a_state_taken_between_lanes_batches_resumes_exactly(shards):
    options = {**OPTIONS, "checkpointing": True}
    whole = list(make_loader(shards, "train", 4, **options))
    for stop in (1, 4, 8):  # after lane 0's first, mid-way, and before the joined last batch
        loader = make_loader(shards, "train", 4, **options)
        it = iter(loader)
        for _ in range(stop):
            next(it)
        state = loader.state_dict()
        assert len(state["dali"]) == 2 and sum(state["handed"]) == stop
        resumed = make_loader(shards, "train", 4, **options)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert [y.tolist() for _, y in rest] == [y.tolist() for _, y in whole[stop:]]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(rest, whole[stop:]))


def test_a_lanes_state_refuses_a_loader_of_one_lane_and_names_the_option(shards):
    loader = make_loader(shards, "train", 4, **{**OPTIONS, "checkpointing": True})
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = make_loader(shards, "train", 4, **{**OPTIONS, "checkpointing": True, "lanes": 1})
    with pytest.raises(ValueError, match="2 lane.*lanes=2.*--lanes"):
        other.load_state_dict(state)


@pytest.mark.parametrize("saved_lanes", [2, 1])
def test_a_state_resumes_in_a_loader_whose_lanes_are_defaulted_with_the_states_lanes(shards, saved_lanes,
                                                                                      monkeypatch):
    """dali-train leaves lanes to the default, which follows the threads and the epoch's length, and a resume
    may change --dali-threads: a loader whose lanes are defaulted restores a state of another number of
    lanes, runs the rest of that epoch in the state's lanes (the same batches as the run that saved it)
    and the next epoch in its own default."""
    options = {**OPTIONS, "checkpointing": True, "lanes": saved_lanes}
    whole = batches_of(make_loader(shards, "train", 4, **options))
    saver = make_loader(shards, "train", 4, **options)
    it = iter(saver)
    for _ in range(3):
        next(it)
    state = saver.state_dict()
    # the default here: one lane on one thread; two on two threads once these 9-batch epochs count as long
    defaulted = {**OPTIONS, "checkpointing": True, "lanes": None, "num_threads": 2 if saved_lanes == 1 else 1}
    monkeypatch.setattr(loader_module, "LANES_MIN_BATCHES", 1)
    resumed = make_loader(shards, "train", 4, **defaulted)
    assert resumed.options.lanes == 3 - saved_lanes
    resumed.load_state_dict(state)
    assert same(batches_of(resumed), whole[3:])
    alone = make_loader(shards, "train", 4, **defaulted)
    alone.set_epoch(1)
    assert same(batches_of(resumed), batches_of(alone))


def test_lanes_stopped_on_two_ranks_resume_on_three_reading_the_rest_once(shards):
    options = {**OPTIONS, "checkpointing": True}
    before = [make_loader(shards, "train", 6, rank=r, world_size=2, **options) for r in range(2)]
    iterators = [iter(loader) for loader in before]
    first = [[next(it) for it in iterators] for _ in range(2)]
    states = [loader.state_dict() for loader in before]
    after = [make_loader(shards, "train", 4, rank=r, world_size=3, **options) for r in range(3)]
    for loader in after:
        loader.load_state_dict(merge_rank_states(states))
    steps = [list(loader) for loader in after]
    assert len({len(s) for s in steps}) == 1
    assert len(first) + len(steps[0]) == N // 12  # the epoch's global batches, as on 2 ranks
    counts = Counter(labels_of([b for step in first for b in step]) + labels_of([b for s in steps for b in s]))
    assert set(counts.values()) == {1} and len(counts) == (N // 12) * 12


def test_a_lane_of_whole_batches_beside_a_longer_one_ends_cleanly(tmp_path):
    """17 samples in lanes of 8 and 9: DALI counts both lanes' epochs in 9 samples, so the lane of two whole
    batches of 4 ends with a batch of no samples; the epoch is still 4 batches (validation: every sample once)."""
    data = one_image_classes(tmp_path, 17, seed=5, prefix="o", samples_per_shard=6)
    train = make_loader(data, "train", 4, **OPTIONS)
    assert [len(y) for _, y in train] == [4] * 4
    val = make_loader(data, "train", 4, train=False, **OPTIONS)
    assert sorted(labels_of(list(val))) == list(range(17))


def batches_of(loader) -> list:
    return [(x.clone(), y.clone()) for x, y in loader]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def test_the_next_epochs_lanes_start_before_this_epoch_ends_and_are_that_epoch(shards):
    """A lane's first batch is a whole batch of its one thread: in lanes, a training loader starts the next
    epoch's once this epoch's have no run left to schedule, and the next iteration reads them: the batches
    of an epoch started ahead are those of the epoch started when asked."""
    loader = make_loader(shards, "train", 4, **OPTIONS)
    it = iter(loader)
    batches = [next(it) for _ in range(len(loader))]
    assert loader._next is not None and loader._next[0] == 1  # started while epoch 0 still had batches
    assert len(batches) == len(loader) and next(it, None) is None
    started_ahead = batches_of(loader)
    alone = make_loader(shards, "train", 4, **OPTIONS)
    alone.set_epoch(1)
    assert same(started_ahead, batches_of(alone))


def test_lanes_started_for_an_epoch_that_is_not_read_next_are_dropped(shards):
    options = {**OPTIONS, "checkpointing": True}
    loader = make_loader(shards, "train", 4, **options)
    list(loader)  # epoch 0, and epoch 1's lanes started
    loader.set_epoch(3)
    alone = make_loader(shards, "train", 4, **options)
    alone.set_epoch(3)
    assert same(batches_of(loader), batches_of(alone))  # epoch 3 (and epoch 4's lanes started)

    other = make_loader(shards, "train", 4, **options)
    it = iter(other)
    next(it), next(it)
    state = other.state_dict()  # inside epoch 0
    loader.load_state_dict(state)
    resumed = make_loader(shards, "train", 4, **options)
    resumed.load_state_dict(state)
    assert same(batches_of(loader), batches_of(resumed))


def test_validation_starts_no_epoch_ahead(shards):
    """Validation runs once between training epochs: its next epoch started would be held through training."""
    val = make_loader(shards, "train", 4, train=False, **OPTIONS)
    list(val)
    assert val._next is None


def test_the_pipeline_of_lane_0_restores_from_its_checkpoint(shards):
    """`loader.pipeline(checkpoint=)` (lane 0's pipeline, defined: what the GPU graph checks use) takes lane 0's
    checkpoint alone: it continues with lane 0's next batch."""
    options = {**OPTIONS, "checkpointing": True}
    whole = list(make_loader(shards, "train", 4, **options))
    loader = make_loader(shards, "train", 4, **options)
    it = iter(loader)
    next(it), next(it)  # a batch of each lane
    state = loader.state_dict()
    pipe = make_loader(shards, "train", 4, **options).pipeline(checkpoint=state["dali"][0])
    pipe.build()
    labels = [int(x) for x in np.asarray(pipe.run()[1].as_tensor()).reshape(-1)]
    assert labels == whole[2][1].tolist()  # lane 0's second batch, the epoch's third
