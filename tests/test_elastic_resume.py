"""Elastic mid-epoch resume at the loader: W ranks stop inside an epoch, their states are merged
(`elastic.merge_rank_states`) and W' ranks (fewer or more) read the rest of the epoch: every sample of the epoch
exactly once, the same number of steps, the rest a function of (seed, epoch, consumed set, W'). Every label of
these shards names its sample (one image per class), so the tests see exactly which samples were read.
dali-train's whole path (torchrun, SIGTERM, a resume on 1 and 3 ranks) is in tests/test_elastic.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.pipelines.elastic import ElasticError, SampleSet, merge_rank_states
from helpers import one_image_classes

GLOBAL_BATCH = 12  # shared by 1, 2, 3 and 4 ranks
OPTIONS = dict(device="cpu", augment=AugmentConfig(image_size=16), seed=5, initial_fill=16, num_threads=1,
               checkpointing=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # 96 samples in tars of 7: 8 steps of the global batch an epoch; a shuffle buffer of 16 makes what a rank
    # has consumed after a few batches anything but a prefix of its slice
    return one_image_classes(tmp_path_factory.mktemp("elastic"), 96, seed=1, prefix="s", samples_per_shard=7)


def ranks(data, world: int, **options) -> list:
    return [make_loader(data, "train", GLOBAL_BATCH // world, rank=r, world_size=world, **{**OPTIONS, **options})
            for r in range(world)]


def take(loaders: list, steps: int) -> tuple[list, list[dict]]:
    """`steps` batches from every rank, in lockstep as DDP reads them, and then every rank's state."""
    iterators = [iter(loader) for loader in loaders]
    batches = [[next(it) for it in iterators] for _ in range(steps)]
    return batches, [loader.state_dict() for loader in loaders]


def labels(batches: list) -> list[int]:
    return [int(x) for step in batches for _, y in step for x in y]


def rest(loaders: list, state: dict) -> list:
    """The rest of the epoch on `loaders`, all given `state`, in lockstep."""
    for loader in loaders:
        loader.load_state_dict(state)
    steps = [list(loader) for loader in loaders]
    assert len({len(s) for s in steps}) == 1, "every rank hands out as many batches"
    return [list(step) for step in zip(*steps)]


@pytest.mark.parametrize("world_after", [1, 3, 4])
def test_the_rest_of_an_epoch_on_another_number_of_ranks_reads_every_sample_once(shards, world_after):
    before, states = take(ranks(shards, 2), 3)
    merged = merge_rank_states(states)
    after = rest(ranks(shards, world_after), merged)
    assert len(before) + len(after) == 96 // GLOBAL_BATCH  # the epoch's steps, as on 2 ranks
    assert all(sum(len(y) for _, y in step) == GLOBAL_BATCH for step in before + after)  # the global batch kept
    seen = Counter(labels(before) + labels(after))
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}
    # the consumed set is the samples handed out before the stop, wherever in its slice each rank found them
    consumed = SampleSet.from_state(merged["excluded"])
    assert consumed.count() == merged["samples_done"] == 3 * GLOBAL_BATCH


def test_two_resumes_of_one_state_on_three_ranks_are_identical_and_the_next_epoch_is_whole(shards):
    _, states = take(ranks(shards, 2), 2)
    merged = merge_rank_states(states)
    first, second = ranks(shards, 3), ranks(shards, 3)
    a, b = rest(first, merged), rest(second, merged)
    assert len(a) == len(b) == 96 // GLOBAL_BATCH - 2
    for step_a, step_b in zip(a, b):
        for (xa, ya), (xb, yb) in zip(step_a, step_b):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
    # the epoch after it is the 3-rank split of the whole split, as a fresh 3-rank run's epoch 1
    fresh = ranks(shards, 3)
    for loader in fresh:
        loader.set_epoch(1)
    next_epoch = [list(step) for step in zip(*(list(loader) for loader in first))]
    assert labels(next_epoch) == labels([list(step) for step in zip(*(list(loader) for loader in fresh))])
    assert sorted(labels(next_epoch)) == list(range(96))


def test_a_second_stop_in_the_resumed_epoch_resumes_again(shards):
    """2 ranks -> 3 ranks -> stop again -> 3 ranks from DALI's checkpoints (the same pipelines) and -> 1 rank
    (merged again): each time the epoch's samples once."""
    before, states = take(ranks(shards, 2), 2)
    three = ranks(shards, 3)
    for loader in three:
        loader.load_state_dict(merge_rank_states(states))
    middle, states3 = take(three, 3)
    again = ranks(shards, 3)
    for loader, state in zip(again, states3):  # same number of ranks: each its own reader checkpoint
        loader.load_state_dict(state)
    tail3 = [list(step) for step in zip(*(list(loader) for loader in again))]
    tail1 = rest(ranks(shards, 1), merge_rank_states(states3))
    for tail in (tail3, tail1):
        seen = Counter(labels(before) + labels(middle) + labels(tail))
        assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}


def test_mixed_datasets_keep_their_shares_and_read_each_sample_once(tmp_path):
    a = one_image_classes(tmp_path / "a", 48, seed=2, prefix="a", samples_per_shard=5)
    b = one_image_classes(tmp_path / "b", 48, seed=3, prefix="b", samples_per_shard=9)

    def mixed(world):
        return [make_loader([a, b], "train", GLOBAL_BATCH // world, rank=r, world_size=world, **OPTIONS)
                for r in range(world)]

    before, states = take(mixed(2), 3)
    after = rest(mixed(3), merge_rank_states(states))
    assert len(before) + len(after) == 96 // GLOBAL_BATCH
    for step in after:  # weights 1:1: half of every batch from each dataset, on 3 ranks as on 2
        for _, y in step:
            assert (y < 48).sum() == (y >= 48).sum() == len(y) // 2
    seen = Counter(labels(before) + labels(after))
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}


def test_states_that_cannot_be_merged_are_refused(shards):
    _, states = take(ranks(shards, 2), 1)
    disagree = [states[0], {**states[1], "samples_done": states[1]["samples_done"] + GLOBAL_BATCH}]
    with pytest.raises(ElasticError, match="disagree"):
        merge_rank_states(disagree)
    with pytest.raises(ElasticError, match="does not record which samples"):
        merge_rank_states([{**s, "seen": None} for s in states])
    # a reader checkpoint of 2 ranks given to 3: refused, not read as a 3-rank one
    with pytest.raises(ElasticError, match="cannot be restored on 3"):
        ranks(shards, 3)[0].load_state_dict(states[0])
    # one rank's state given for both: its samples counted twice
    with pytest.raises(ElasticError, match="6 samples more than once"):
        merge_rank_states([states[0], states[0]])
    # a rank's record that lost a sample no longer adds up to the cursor
    one = SampleSet.from_state(states[0]["seen"])
    shard = next(iter(one.bits))
    one.bits[shard][one.bits[shard].argmax()] = False
    with pytest.raises(ElasticError, match="distinct samples"):
        merge_rank_states([{**states[0], "seen": one.to_state()}, states[1]])
