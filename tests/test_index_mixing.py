"""Mixing datasets: `make_loader([A, B], "train", weights=...)` on real shards (a ShardWriter folder with
integer classes, a folder of class names), through the real DALI loader on the CPU."""

from __future__ import annotations

import tarfile
from collections import Counter

import pytest
import torch

from dalifeed.convert.index import IndexConfig, index_folder
from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset
from dalifeed.pipelines.dataset import MixError, batch_shares, union_classes
from test_index import add_member, solid, write_shardwriter

ARGS = dict(device="cpu", augment=AugmentConfig(image_size=16), num_threads=1, initial_fill=8)


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """A: 40 train samples, classes "0", "1", "2" (ShardWriter, .cls); B: 12 train + 6 val samples of classes
    "cat", "dog" (.txt). Union: ["0", "1", "2", "cat", "dog"]; every image's red level encodes its union index."""
    root = tmp_path_factory.mktemp("mix")
    write_shardwriter(root / "A", "train", 40, per_shard=15)
    write_shardwriter(root / "A", "val", 9, per_shard=15, seed=1)
    index_folder(IndexConfig(root / "A"))
    (root / "B").mkdir()
    for split, n in (("train", 12), ("val", 6)):
        with tarfile.open(root / "B" / f"{split}-000000.tar", "w") as tar:
            for i in range(n):
                name = ("cat", "dog")[i % 2]
                add_member(tar, f"{i:05d}.jpg", solid(3 + i % 2))
                add_member(tar, f"{i:05d}.txt", name.encode())
    index_folder(IndexConfig(root / "B", label_member="txt"))
    return root / "A", root / "B"


def red_levels(images: torch.Tensor) -> list[int]:
    red = images[:, 0].mean(dim=(1, 2)) * 0.229 * 255 + 0.485 * 255
    return [round((float(r) - 10) / 30) for r in red]


def test_batch_shares_and_union():
    assert batch_shares([3, 1], 8) == [6, 2] and batch_shares([0.75, 0.25], 256) == [192, 64]
    assert batch_shares([1, 1, 1], 10) == [4, 3, 3] and sum(batch_shares([0.7, 0.2, 0.1], 33)) == 33
    assert union_classes([["b", "a"], ["c", "a"]]) == (["a", "b", "c"], [[1, 0], [2, 0]])
    with pytest.raises(MixError, match="weights must be positive"):
        batch_shares([1, 0], 8)


def test_mixing_proportions_classes_and_epoch(two_datasets):
    a, b = two_datasets
    loader = make_loader(open_dataset([a, b], weights=[0.75, 0.25]), "train", 8, **ARGS)
    assert loader.dataset.classes == ["0", "1", "2", "cat", "dog"]
    assert len(loader) == (40 + 12) // 8  # an epoch: as many samples as both hold together
    drawn = Counter()
    for images, labels in loader:
        assert labels.tolist() == red_levels(images)  # each label, mapped to the union, is its image's
        drawn.update("B" if label >= 3 else "A" for label in labels.tolist())
    share = drawn["A"] / sum(drawn.values())
    assert abs(share - 0.75) <= 0.05 and sum(drawn.values()) == 48  # B (12 samples) gave 12 of 48: repeated
    assert drawn["B"] == 12


def test_mixed_order_depends_on_seed_and_epoch_and_resume_is_exact(two_datasets):
    a, b = two_datasets
    args = dict(checkpointing=True, seed=5, **ARGS)
    full = make_loader(open_dataset([a, b], weights=[3, 1]), "train", 8, **args)
    epoch0 = [labels.tolist() for _, labels in full]
    epoch1 = [(images, labels) for images, labels in full]
    again = make_loader(open_dataset([a, b], weights=[3, 1]), "train", 8, **args)
    again.set_epoch(1)
    assert [labels.tolist() for _, labels in again] == [labels.tolist() for _, labels in epoch1]
    assert epoch0 != [labels.tolist() for _, labels in epoch1]
    first = make_loader(open_dataset([a, b], weights=[3, 1]), "train", 8, **args)
    first.set_epoch(1)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = make_loader(open_dataset([a, b], weights=[3, 1]), "train", 8, **args)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(epoch1) - 3
    for (images, labels), (want_images, want_labels) in zip(rest, epoch1[3:]):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)
    assert resumed.epoch == 2


def test_mixed_evaluation_per_dataset(two_datasets):
    a, b = two_datasets
    loader = make_loader([a, b], "val", 4, **ARGS)
    per = {name: Counter(label for _, labels in part for label in labels.tolist())
           for name, part in loader.per_dataset.items()}
    assert per[str(a)].keys() <= {0, 1, 2} and sum(per[str(a)].values()) == 9
    assert per[str(b)] == {3: 3, 4: 3}
    assert sum(len(labels) for _, labels in loader) == 15


def test_mixing_refusals(two_datasets):
    a, b = two_datasets
    with pytest.raises(MixError, match="2 weights for 1 datasets"):
        make_loader(open_dataset([a], weights=[1, 2]), "train", 8, **ARGS)
    with pytest.raises(MixError, match="gives it no sample of a batch of 8"):
        make_loader(open_dataset([a, b], weights=[100, 1]), "train", 8, **ARGS)
    with pytest.raises(ValueError, match="mixes a list of shard folders"):
        make_loader(open_dataset(a, weights=[1]), "train", 8, **ARGS)
    for again in (a, a.parent / "." / a.name, str(a) + "/"):  # the same folder, however it is written
        with pytest.raises(MixError, match=r"the same dataset is given twice .*--data-weights"):
            make_loader([a, b, again], "train", 8, **ARGS)


def test_dali_train_mixes_two_datasets_and_reports_each(two_datasets, tmp_path):
    """Done means: `dali-train --data A --data B --data-weights 3,1` trains, with the union's classes in the
    run's config and checkpoint, and reports each dataset's validation."""
    import json
    import subprocess

    from dalifeed.train import checkpoint
    from test_index import ENV, VENV_BIN

    a, b = two_datasets
    run = subprocess.run([str(VENV_BIN / "dali-train"), "--data", str(a), "--data", str(b), "--data-weights", "3,1",
                          "--out", str(tmp_path / "run"), "--epochs", "1", "--model", "resnet18", "--image-size", "16",
                          "--batch-size", "8", "--device", "cpu", "--dali-threads", "1", "--progress-every", "0"],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["A/val_samples"] == 9 and record["B/val_samples"] == 6 and record["val_samples"] == 15
    assert record["top1"] == pytest.approx((record["A/top1"] * 9 + record["B/top1"] * 6) / 15)
    # 40 + 12 train samples: 6 batches of 8 an epoch, 6 + 2 of each batch from A and B
    assert ("mixing 2 datasets, in every batch of 8 (per process): A 6 (75%, weight 3, 40 train samples, 0.9 passes "
            "an epoch); B 2 (25%, weight 1, 12 train samples, 1 pass an epoch)") in run.stdout + run.stderr
    assert "--cache-dir" not in run.stdout + run.stderr  # not given: no warning
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [(m["name"], m["per_batch"], m["train_samples"]) for m in config["mixing"]] == [("A", 6, 40), ("B", 2, 12)]
    assert config["data"] == [str(a), str(b)] and config["data_weights"] == [3.0, 1.0]
    assert config["classes"] == ["0", "1", "2", "cat", "dog"]
    assert checkpoint.load(tmp_path / "run" / "last.pt")["classes"] == ["0", "1", "2", "cat", "dog"]
    bad = subprocess.run([str(VENV_BIN / "dali-train"), "--data", str(a), "--data", str(b), "--data-weights", "3",
                          "--out", str(tmp_path / "run2")], capture_output=True, text=True, env=ENV, timeout=600)
    assert bad.returncode == 2 and "one weight per --data (2 given)" in bad.stderr
    twice = subprocess.run([str(VENV_BIN / "dali-train"), "--data", str(a), "--data", str(a), "--out",
                            str(tmp_path / "run3")], capture_output=True, text=True, env=ENV, timeout=600)
    assert twice.returncode == 2 and f"the same dataset is given twice ({a} and {a})" in twice.stderr
    assert "Traceback" not in twice.stderr and sum(line.startswith("Error:") for line in twice.stderr.splitlines()) == 1


def test_every_rank_gets_the_same_number_of_mixed_batches(two_datasets):
    a, b = two_datasets
    counts = []
    for rank in range(3):
        loader = make_loader(open_dataset([a, b], weights=[3, 1]), "train", 4, rank=rank, world_size=3, **ARGS)
        counts.append((len(loader), sum(1 for _ in loader)))
    assert counts == [((40 + 12) // 3 // 4,) * 2] * 3


def test_preview_captions_read_the_label_member_index_was_told(two_datasets, tmp_path):
    """dali-train --preview on adopted shards: captions come from the member `shard-convert index` read the
    labels from (.txt class names here, .json with --label-key below), not only from .cls."""
    import json

    from dalifeed.pipelines.preview import first_samples
    from dalifeed.shardfolder import open_shard_folder

    _, b = two_datasets
    _, captions = first_samples(b, "train", 4)
    classes = open_shard_folder(b).classes
    assert captions == [f"{classes.index(name)} {name}" for name in ("cat", "dog", "cat", "dog")]

    folder = tmp_path / "J"
    folder.mkdir()
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i in range(3):
            add_member(tar, f"{i:05d}.jpg", solid(i))
            add_member(tar, f"{i:05d}.json", json.dumps({"caption": "x", "label": 2 - i}).encode())
    index_folder(IndexConfig(folder, label_member="json", label_key="label"))
    _, captions = first_samples(folder, "train", 3)
    classes = open_shard_folder(folder).classes
    assert captions == [f"{label} {classes[label]}" for label in (2, 1, 0)]
