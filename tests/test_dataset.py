"""The data opened once (pipelines/dataset.py), the one epoch cursor (pipelines/cursor.py), the next epoch's
graph defined ahead (loader.py), and dali-bench's warm-up draining each loader's read-ahead."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from dalifeed.pipelines import AugmentConfig, LoaderOptions, make_loader, open_dataset
from dalifeed.pipelines.cursor import EpochCursor
from dalifeed.pipelines.dataset import DatasetError, MixError
from helpers import one_image_classes

N = 29  # prime: no batch size or world size used here divides it


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """N one-image classes: each sample's label names it."""
    return one_image_classes(tmp_path_factory.mktemp("dataset"), N, seed=1, prefix="c", samples_per_shard=5)


def test_open_dataset_refuses_in_one_line_what_no_loader_could_read(shards, tmp_path):
    with pytest.raises(DatasetError, match=r"^split val: .* has no such split \(has: train\)$"):
        open_dataset(shards, splits=("train", "val"))
    with pytest.raises(DatasetError, match=r"holds imagefolder shards: multilabel needs COCO shards"):
        open_dataset(shards, task="multilabel")
    with pytest.raises(MixError, match=r"^weights=\[1\.0\] mixes a list of shard folders"):
        open_dataset(shards, weights=[1.0])
    with pytest.raises(MixError, match=r"the same dataset is given twice"):
        open_dataset([shards, f"{shards}/."])
    with pytest.raises(ValueError, match=r"'5G': write GB \(powers of 1000\) or GiB"):
        open_dataset(shards, cache_limit="5G")  # a bad size fails before anything is opened


def test_the_batch_fit_is_one_rule_with_the_numbers_in_its_line(shards):
    dataset = open_dataset(shards, splits=("train",))
    dataset.check_batch_fits("train", 14, world_size=2)  # 14 samples each: one full batch
    with pytest.raises(DatasetError, match=rf"batch 15 is more than the 14 samples of split 'train' each of 2 "
                                           rf"process\(es\) gets \({N} in all\)"):
        dataset.check_batch_fits("train", 15, world_size=2)
    with pytest.raises(DatasetError, match="batch 15 is more than"):  # the loader asks the same rule
        make_loader(dataset, "train", 15, rank=0, world_size=2, device="cpu")


def test_a_loader_from_a_loaderoptions_record_reads_what_keywords_read(shards):
    """The config route (a run's LoaderOptions, printed and saved) is the same door: make_loader(**asdict())."""
    dataset = open_dataset(shards)
    options = LoaderOptions("train", 4, train=False, device="cpu", num_threads=1)
    augment = AugmentConfig(image_size=16)
    by_config = [labels.tolist() for _, labels in make_loader(dataset, **asdict(options), augment=augment)]
    by_keywords = [labels.tolist() for _, labels in make_loader(str(shards), "train", 4, augment=augment, train=False,
                                                                device="cpu", num_threads=1)]
    assert by_config == by_keywords and sorted(sum(by_config, [])) == list(range(N))


def test_the_cursor_counts_what_every_rank_consumed_and_reads_old_checkpoints():
    cursor = EpochCursor(global_batch=4 * 3)
    cursor.start(2)
    cursor.advance()
    cursor.advance()
    assert cursor.state_dict() == {"epoch": 2, "samples_done": 24} and cursor.batches_done == 2
    old = EpochCursor(global_batch=12)
    old.load_state_dict({"epoch": 5, "batches_done": 3, "dali": None})  # a checkpoint from before the cursor
    assert (old.epoch, old.samples_done, old.batches_done) == (5, 36, 3)
    cursor.finish()
    assert cursor.state_dict() == {"epoch": 3, "samples_done": 0}


def test_an_epoch_defined_ahead_is_the_epoch_a_fresh_loader_reads(shards):
    """The next epoch's graph is defined on a background thread while this one runs: what it yields must be
    exactly what a loader that defines that epoch on the spot yields (same order, same crops), and a jump
    elsewhere (set_epoch) must not read the graph defined ahead for another epoch."""
    def loader():
        return make_loader(shards, "train", 4, augment=AugmentConfig(image_size=16), seed=7, device="cpu",
                           num_threads=1)

    running = loader()
    assert running.definitions.ahead == 0  # the first epoch, at construction
    list(running)
    assert running.definitions.ahead is None and running._next[0] == 1  # defined, then started, while epoch 0 ran
    ahead = [(images.clone(), labels.clone()) for images, labels in running]  # epoch 1, from the graph ahead

    fresh = loader()
    fresh.set_epoch(1)  # the graph defined at construction is epoch 0's: this one is defined on the spot
    on_the_spot = [(images.clone(), labels.clone()) for images, labels in fresh]
    assert len(ahead) == len(on_the_spot) == N // 4
    for (a_images, a_labels), (b_images, b_labels) in zip(ahead, on_the_spot):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)

    jumped = loader()
    jumped.set_epoch(3)
    assert [labels.tolist() for _, labels in jumped] != [labels.tolist() for _, labels in on_the_spot]


def test_the_bench_warm_up_drains_each_loaders_read_ahead(shards, tmp_path):
    """A window that began with prefetched batches would count them as made inside it."""
    from dalifeed.bench.loaders import DEFAULT_AHEAD, batches_ahead
    from dalifeed.bench.loaders import race_loader as bench_loader
    from dalifeed.bench.run import on_device

    cpu = torch.device("cpu")
    common = dict(imagefolder=tmp_path, shards=shards, split="train", batch_size=4, image_size=16, device=cpu)
    webdataset = bench_loader("webdataset", workers=2, **common)
    assert batches_ahead(on_device(webdataset, cpu)) == 2 * 4  # 2 workers x prefetch_factor 4
    dali = bench_loader("dali-cpu", workers=1, **common)
    assert batches_ahead(on_device(dali, cpu)) == dali.options.prefetch_queue_depth == 2
    assert batches_ahead(object()) == DEFAULT_AHEAD
