"""An epoch's pipeline made from the loader's first, serialized, with the epoch's reader arguments
(dalifeed/pipelines/serialized.py) reads and augments exactly what the graph defined afresh for that epoch does,
in one lane and in two; checkpoints taken from either restore into the other; a serialized pipeline without one
webdataset reader to re-aim is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvidia.dali import fn, pipeline_def

from dalifeed.pipelines import make_loader
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.pipelines.serialized import NotEditable, SerializedPipeline, with_reader_arguments, without_origins
from helpers import one_image_classes

N = 29
# a policy and erasing: the graph with conditionals and most random operators, whose seeds DALI draws when the
# pipeline is built
AUGMENT = AugmentConfig(auto_augment="ta_wide", random_erase=0.5, image_size=16)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return one_image_classes(tmp_path_factory.mktemp("serialized"), N, seed=5, prefix="s", samples_per_shard=4)


def loader_of(shards, lanes: int, **extra):
    return make_loader(shards, "train", 4, device="cpu", seed=7, initial_fill=8, num_threads=2, augment=AUGMENT,
                       lanes=lanes, **extra)


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_epoch_made_from_the_first_pipeline_is_the_epoch_defined_afresh(shards, lanes):
    loader = loader_of(shards, lanes)
    list(loader)  # epoch 0: the graph is defined, and serialized
    made, kinds = [], set()
    for batch in loader:  # epoch 1: made from it
        kinds |= {type(pipe) for pipe in loader._iterator.pipes}
        made.append(batch)
    assert kinds == {SerializedPipeline}
    defined = loader_of(shards, lanes)
    defined.set_epoch(1)  # its first pipeline: defined for epoch 1
    assert same_batches(made, list(defined))


def test_checkpoints_restore_from_a_made_pipeline_into_a_defined_one_and_back(shards):
    options = dict(checkpointing=True)
    whole = loader_of(shards, 2, **options)
    list(whole)
    epoch1 = list(whole)

    made = loader_of(shards, 2, **options)
    list(made)
    it = iter(made)
    head = [next(it) for _ in range(3)]
    state = made.state_dict()  # the checkpoints of pipelines made from the serialized graph
    defined = loader_of(shards, 2, **options)
    defined.load_state_dict(state)  # ... restored into pipelines defined afresh
    assert same_batches(head + list(defined), epoch1)

    defined = loader_of(shards, 2, **options)
    defined.set_epoch(1)
    it = iter(defined)
    head = [next(it) for _ in range(2)]
    state = defined.state_dict()  # the checkpoints of defined pipelines
    made.load_state_dict(state)  # ... restored into pipelines made from the serialized graph
    rest = []
    for batch in made:
        assert all(isinstance(pipe, SerializedPipeline) for pipe in made._iterator.pipes)
        rest.append(batch)
    assert same_batches(head + rest, epoch1)


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def no_reader():
    return fn.random.uniform(range=[0, 1])


def test_a_pipeline_without_a_webdataset_reader_is_refused_in_one_line():
    serialized = no_reader().serialize()
    with pytest.raises(NotEditable, match="^the pipeline has 0 webdataset readers, not 1$"):
        with_reader_arguments(serialized, shard_id=1)


def test_a_reader_argument_that_is_not_there_is_refused(shards):
    serialized = loader_of(shards, 1).pipeline(epoch=0).serialize()
    with pytest.raises(NotEditable, match="no argument.*'file_root'"):
        with_reader_arguments(serialized, file_root=["x"])


def test_without_origins_keeps_the_graph_and_drops_where_it_was_defined(shards):
    pipe = loader_of(shards, 1).pipeline(epoch=0)
    serialized = pipe.serialize()
    lean = without_origins(serialized)
    assert b"_origin_stack_" in serialized and b"_origin_stack_" not in lean and len(lean) < len(serialized) / 2
    made = SerializedPipeline(lean, batch_size=4, num_threads=1, device_id=None, seed=pipe.seed,
                              prefetch_queue_depth=2, exec_dynamic=True)
    pipe.build()
    made.build()
    for _ in range(2):
        for a, b in zip(pipe.run(), made.run()):
            assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
