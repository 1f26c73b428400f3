"""make_loader's epoch contract, checked with one image per class so a label names its sample."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from dalifeed.pipelines import AugmentConfig, DetectionConfig, make_detection_loader, make_loader, open_dataset
from dalifeed.pipelines.dataset import Source
from dalifeed.pipelines.loader import trains
from helpers import one_image_classes

N = 37  # prime: divisible by no batch size or world size used here


@pytest.fixture(scope="module")
def unique_shards(tmp_path_factory) -> Path:
    return one_image_classes(tmp_path_factory.mktemp("unique"), N, seed=0, prefix="s", samples_per_shard=6)


def labels_of(loader) -> list[list[int]]:
    return [labels.tolist() for _, labels in loader]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch", [4, 5])
def test_validation_sees_every_sample_exactly_once_across_ranks(unique_shards, world_size, batch):
    seen = []
    for rank in range(world_size):
        loader = make_loader(unique_shards, "train", batch, augment=AugmentConfig(image_size=16), train=False,
                             rank=rank, world_size=world_size, device="cpu")
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
        loader = make_loader(unique_shards, "train", batch, augment=AugmentConfig(image_size=16), rank=rank,
                             world_size=world_size, device="cpu", seed=5)
        assert len(loader) == expected
        for _epoch in range(3):
            batches = labels_of(loader)
            assert len(batches) == expected and all(len(b) == batch for b in batches)
            flat = [label for b in batches for label in b]
            assert len(set(flat)) == len(flat)  # no duplicates (padding) inside an epoch
        per_rank.append(flat)
    if world_size > 1:
        assert not set(per_rank[0]) & set(per_rank[1])  # ranks read disjoint slices in the same epoch


def epoch_orders(shards, seed, epochs=2):
    loader = make_loader(shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu", seed=seed)
    return [sum(labels_of(loader), []) for _ in range(epochs)]


def test_same_seed_same_order_and_different_seed_different_order(unique_shards):
    a, b, c = epoch_orders(unique_shards, 0), epoch_orders(unique_shards, 0), epoch_orders(unique_shards, 1)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # reshuffled between epochs
    assert a[0] != sorted(a[0])


def test_set_epoch_replays_an_epoch_exactly(unique_shards):
    """What a resumed trainer relies on: epoch e's samples and augmentations depend only on (seed, e)."""
    straight = make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu", seed=9)
    for _ in range(2):
        list(straight)
    third = [(x.clone(), y.clone()) for x, y in straight]

    resumed = make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu", seed=9)
    resumed.set_epoch(2)
    replay = list(resumed)
    assert len(third) == len(replay)
    for (x1, y1), (x2, y2) in zip(third, replay):
        assert torch.equal(y1, y2) and torch.equal(x1, x2)


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_a_loader_restored_mid_epoch_yields_exactly_the_rest_of_it(unique_shards, rank, world_size):
    def loader():
        return make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), rank=rank,
                           world_size=world_size, seed=3, device="cpu", checkpointing=True)

    straight = loader()
    epoch0 = [(images.clone(), labels.clone()) for images, labels in straight]
    epoch1 = [labels.tolist() for _, labels in straight]

    first = loader()
    batches = iter(first)
    for _ in range(2):
        next(batches)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["samples_done"] == 2 * 4 * world_size and state["dali"]  # every rank's
    del batches, first

    resumed = loader()
    resumed.load_state_dict(state)
    rest = [(images.clone(), labels.clone()) for images, labels in resumed]
    assert len(rest) == len(epoch0) - 2  # the rank with a spare batch still drops it
    for (a_images, a_labels), (b_images, b_labels) in zip(rest, epoch0[2:]):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)  # same samples, same crops
    assert [labels.tolist() for _, labels in resumed] == epoch1  # and the next epoch is the usual one
    assert resumed.state_dict() == {"epoch": 2, "samples_done": 0, "dali": None}


def built_pipelines() -> list:
    """The DALI pipelines alive and built in this process (defined ones, such as an epoch defined ahead,
    hold no threads or buffers yet)."""
    import gc

    from nvidia.dali import Pipeline

    gc.collect()
    return [p for p in gc.get_objects() if issubclass(type(p), Pipeline) and p._built]


def test_a_consumer_that_stops_mid_epoch_frees_the_pipeline_and_keeps_its_place(unique_shards):
    """A `break` (a stop, an accumulation window's remainder) closes the loader's generator: its pipeline goes
    at once, so validation's runs alone, and the state where it stopped is still what state_dict gives (a
    fresh loader given it yields exactly the rest)."""
    def loader():
        return make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), seed=3, device="cpu",
                           checkpointing=True)

    straight = [labels.tolist() for _, labels in loader()]
    train, val = loader(), make_loader(unique_shards, "train", 5, augment=AugmentConfig(image_size=16), train=False,
                                       device="cpu")
    for i, (_, _labels) in enumerate(train):
        if i == 2:
            break
    state = train.state_dict()
    assert state["samples_done"] == 3 * 4 and state["dali"]
    for _ in val:
        assert len(built_pipelines()) == 1  # validation's: training's went at the break
    assert train.state_dict() == state
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # loaded, not yet read
    assert [labels.tolist() for _, labels in resumed] == straight[3:]


def test_a_one_lane_training_loader_starts_its_next_epoch_before_this_one_ends(unique_shards):
    """So the next epoch's first batch is ready when it begins (gpu-evidence.md, "A pipeline per epoch"): the
    started pipeline is epoch 1's, and what it yields is epoch 1 exactly as a fresh loader's set_epoch(1)."""
    def loader():
        return make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), seed=5, device="cpu",
                           lanes=1)

    running = loader()
    list(running)
    assert running._next is not None and running._next[0] == 1 and len(running._next[1].pipes) == 1
    val = make_loader(unique_shards, "train", 5, augment=AugmentConfig(image_size=16), train=False, device="cpu")
    for _ in val:  # validation's and the next epoch's (idle, started): never epoch 0's, which went at its end
        assert len(built_pipelines()) == 2 and running._iterator is None
    fresh = loader()
    fresh.set_epoch(1)
    assert labels_of(running) == labels_of(fresh)


def test_a_mid_epoch_state_needs_checkpointing(unique_shards):
    loader = make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu")
    batches = iter(loader)
    next(batches)
    with pytest.raises(RuntimeError, match="checkpointing=True"):
        loader.state_dict()


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("train, batch, world_size", [(True, 4, 1), (True, 5, 2), (False, 4, 1), (False, 5, 3)])
def test_an_epoch_runs_its_pipeline_no_further_than_its_last_batch(unique_shards, train, batch, world_size, lanes):
    """epoch_iterator.EpochIterator: when the epoch ends, every run DALI was given has been fetched (DALI's own
    iterator leaves prefetch_queue_depth runs of the next epoch in flight, which the pipeline's teardown waits
    for), and training still decodes its dropped partial batch."""
    loader = make_loader(unique_shards, "train", batch, augment=AugmentConfig(image_size=16), train=train,
                         rank=world_size - 1, world_size=world_size, device="cpu", seed=2, num_threads=2, lanes=lanes)
    for _epoch in range(2):
        pipes = []
        handed_out = 0
        for _ in loader:
            pipes = loader._iterator.pipes  # the epoch's pipeline, kept past its release
            handed_out += 1
        assert handed_out == len(loader)
        rank = world_size - 1
        assert len(pipes) == lanes
        for lane, pipe in enumerate(pipes):
            assert pipe._batches_to_consume == 0  # scheduled and never fetched: none
            shard, shards = rank * lanes + lane, world_size * lanes
            slice_size = (shard + 1) * N // shards - shard * N // shards  # what the lane's reader reads
            assert pipe._consumer_iter == -(-slice_size // batch)  # every run that read it, partial included
        del pipes, pipe


@pytest.mark.parametrize("wanted", [0, 10**6, None])
def test_an_iterator_that_counts_runs_wrongly_still_hands_out_the_whole_epoch(unique_shards, wanted):
    """If a later DALI counts an epoch's runs differently from EpochIterator: too few scheduled are scheduled when
    fetched, too many are waited for, and without the DALI fields it reads (None) DALI schedules as it does
    itself; the epoch is the same every way."""
    from nvidia.dali.plugin.pytorch import LastBatchPolicy

    from dalifeed.pipelines.epoch_iterator import EpochIterator

    class Miscounting(EpochIterator):
        def _runs_to_fetch_after_this_one(self) -> int:
            return wanted

        def _bounded(self) -> bool:
            return wanted is not None and super()._bounded()

    def epoch(cls) -> list[list[int]]:
        loader = make_loader(unique_shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu", seed=4,
                             lanes=1)
        (pipe,), _, _ = loader.definitions.define(0)
        pipe.build()
        iterator = cls([pipe], ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP,
                       auto_reset=False)
        return [batch[0]["labels"].flatten().tolist() for batch in iterator]

    expected = epoch(EpochIterator)
    assert len(expected) == N // 4
    assert epoch(Miscounting) == expected


@pytest.mark.parametrize("split, train, expected", [
    ("train", None, True), ("train2017", None, True), ("training", None, True), ("trainval", None, True),
    ("val", None, False), ("val2017", None, False), ("validation", None, False), ("test", None, False),
    ("mini", None, False), ("val", True, True), ("train", False, False)])
def test_one_rule_says_which_splits_train(split, train, expected):
    assert trains(split, train) is expected


@pytest.fixture(scope="module")
def coco_train2017(tmp_path_factory) -> Path:
    """tests/helpers.write_coco's 8 images as split 'train2017'."""
    from dalifeed.convert.coco import CocoConfig, convert_coco
    from helpers import write_coco

    tmp = tmp_path_factory.mktemp("coco")
    images, annotations = write_coco(tmp / "coco")
    convert_coco(CocoConfig(images=[images], annotations=[annotations], split=["train2017"], out=tmp / "out",
                            progress=False, workers=1))
    return tmp / "out"


def test_both_factories_train_a_split_named_like_coco_train2017(coco_train2017):
    """8 images in batches of 3: training yields 2 full batches, validation 3 (the last one partial). Both
    factories decide by the same rule (make_loader used to evaluate 'train2017' unless told to train)."""
    common = {"device": "cpu", "num_threads": 1, "initial_fill": 8}
    detection = make_detection_loader(coco_train2017, "train2017", 3, detection=DetectionConfig(size=32), **common)
    multilabel = make_loader(open_dataset(coco_train2017, task="multilabel"), "train2017", 3,
                             augment=AugmentConfig(image_size=16), **common)
    assert len(detection) == len(multilabel) == 2
    assert [len(labels) for _, labels in multilabel] == [3, 3]
    assert len(make_loader(open_dataset(coco_train2017, task="multilabel"), "train2017", 3,
                           augment=AugmentConfig(image_size=16), train=False, **common)) == 3


def test_an_epoch_reads_the_files_its_files_function_names(unique_shards, tmp_path):
    """The one place that says where an epoch's tars are (what a local cache of s3:// tars hooks into): with
    the tars moved after the manifest check, a loader whose `files` points at their new place reads them all."""
    from dalifeed.format import ShardManifest
    from dalifeed.pipelines.augment import AugmentConfig
    from dalifeed.pipelines.graphs import shard_pipeline
    from dalifeed.pipelines.loader import DaliLoader, LoaderOptions, epoch_files, images_and_labels

    shards, moved = tmp_path / "shards", tmp_path / "moved"
    shutil.copytree(unique_shards, shards)
    moved.mkdir()
    asked = []

    def files_in_moved(manifest, shards):
        asked.append([s.path for s in shards])
        tars, indexes = epoch_files(manifest, shards)
        return [str(moved / Path(tar).name) for tar in tars], indexes

    options = LoaderOptions("train", 4, train=False, num_threads=1).resolved()
    loader = DaliLoader(Source(str(shards), ShardManifest.load(shards)), options, files=files_in_moved,
                        graph=partial(shard_pipeline, cfg=AugmentConfig(image_size=16)),
                        to_torch=partial(images_and_labels, channels_last=False, multilabel=False))
    for tar in shards.rglob("*.tar"):
        tar.rename(moved / tar.name)
    assert sorted(label for batch in labels_of(loader) for label in batch) == list(range(N))
    assert asked and sorted(asked[0]) == sorted(s.path for s in loader.manifest.split_info("train").shards)


def test_a_fork_waits_for_a_pipeline_being_defined_ahead():
    """A child forked while a loader's background thread defines a graph would inherit the locks that thread
    holds (an import lock: the child hung at its first import); `definitions.DEFINITIONS_AHEAD` makes the fork wait."""
    import os
    import threading
    import time

    from dalifeed.pipelines.definitions import DEFINITIONS_AHEAD

    started, finished = threading.Event(), []

    def slow_definition():
        started.set()
        time.sleep(0.5)
        finished.append(time.monotonic())

    thread = threading.Thread(target=DEFINITIONS_AHEAD.run, args=(slow_definition,))
    thread.start()
    started.wait()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked = time.monotonic()
    os.waitpid(pid, 0)
    thread.join()
    assert finished and forked >= finished[0]
