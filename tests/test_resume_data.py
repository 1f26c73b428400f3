"""A checkpoint knows the shards it trained on (each dataset's shard paths and sha256s per split): a resume on
shards re-converted in place is refused in one line, mid-epoch always, at an epoch's end unless
--allow-data-change says so (recorded in metrics.jsonl); the same shards resume as before; a checkpoint of an
older dalifeed resumes with one warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.pipelines import open_dataset
from dalifeed.train import checkpoint
from dalifeed.train.cli import main as train_cli
from dalifeed.train.resume import data_changes
from fast_recipe import fast_args
from helpers import write_imagefolder


class Killed(BaseException):
    """Stands in for a kill -9 right after a checkpoint reached the disk."""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("resume-data") / "src"
    write_imagefolder(src / "train", {"red": 17, "green": 15, "blue": 13}, seed=0)
    write_imagefolder(src / "val", {"red": 7, "green": 7, "blue": 7}, seed=1)
    return src


def convert(src: Path, out: Path, seed: int) -> Path:
    convert_imagefolder(ConvertConfig(src=src, out=out, samples_per_shard=10, progress=False, seed=seed))
    return out


def reconvert_in_place(src: Path, data: Path, seed: int) -> Path:
    """The same source converted again into the same folder with another seed (other tars, other sha256s);
    the old folder moved aside, where it can be put back."""
    aside = data.with_name(data.name + f"-before-{seed}")
    data.rename(aside)
    convert(src, data, seed)
    return aside


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_mid_epoch_checkpoint_on_shards_converted_again_is_refused(source, tmp_path, monkeypatch):
    data, run = convert(source, tmp_path / "data", seed=0), tmp_path / "run"
    real_save = checkpoint.save

    def save_then_die(path, state):
        real_save(path, state)
        if state.get("midway") and state["state"]["step"] == 2:
            raise Killed

    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(checkpoint, "save", save_then_die)
        CliRunner().invoke(train_cli, ["--data", str(data), "--out", str(run), *fast_args(epochs=2, width=8),
                                       "--checkpoint-every", "1"])
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["midway"] and [s[0] for s in saved["data"][0]["splits"]["train"]][:2] == \
        ["train-000000.tar", "train-000001.tar"]

    aside = reconvert_in_place(source, data, seed=1)
    for extra in ([], ["--allow-data-change"]):  # mid-epoch: never
        refused = CliRunner().invoke(train_cli, ["--resume", str(run), *extra])
        assert refused.exit_code == 2, refused.output
        assert len(errors(refused.output)) == 1 and errors(refused.output) == [refused.output.strip().splitlines()[-1]]
        line = errors(refused.output)[0]
        assert f"{run}/last.pt was trained on other shards than --data holds now (split 'train' of {data}: 5 shards " \
               f"then, 5 now, " in line and "sha256 " in line, line
        assert line.endswith("it was saved mid-epoch and names positions in the tars it read, so it cannot continue on "
                             "these; restore the shards it trained on, or start a new --out"), line

    shutil.rmtree(data)
    aside.rename(data)  # the shards it trained on, back: the resume goes on
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert "starting at epoch 0, batch 2 of 5" in resumed.output


def test_an_epoch_end_checkpoint_continues_on_changed_shards_only_when_told(source, tmp_path):
    data, run = convert(source, tmp_path / "data", seed=0), tmp_path / "run"
    first = CliRunner().invoke(train_cli, ["--data", str(data), "--out", str(run), *fast_args(epochs=1, width=8)])
    assert first.exit_code == 0, first.output
    reconvert_in_place(source, data, seed=2)

    refused = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2"])
    assert refused.exit_code == 2, refused.output
    assert errors(refused.output)[0].endswith("continue on them with --allow-data-change (recorded in metrics.jsonl), "
                                              "or restore the shards it trained on"), refused.output

    allowed = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2", "--allow-data-change"])
    assert allowed.exit_code == 0, allowed.output
    records = metrics(run)
    assert [r["epoch"] for r in records] == [0, 1] and "data_changed" not in records[0]
    assert records[1]["data_changed"].startswith(f"split 'train' of {data}: 5 shards then, 5 now")
    # the next resume compares with the shards it now trained on, and the flag was for that one resume
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["data"] == open_dataset(str(data)).contents(["train", "val"])
    again = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "3"])
    assert again.exit_code == 0 and "data_changed" not in metrics(run)[2], again.output
    reconvert_in_place(source, data, seed=3)
    refused = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "4"])
    assert refused.exit_code == 2 and "--allow-data-change" in errors(refused.output)[0], refused.output


def test_a_checkpoint_that_does_not_name_its_shards_resumes_with_a_warning(source, tmp_path):
    data, run = convert(source, tmp_path / "data", seed=0), tmp_path / "run"
    assert CliRunner().invoke(train_cli, ["--data", str(data), "--out", str(run),
                                          *fast_args(epochs=1, width=8)]).exit_code == 0
    saved = torch.load(run / "last.pt", weights_only=False)
    del saved["data"]  # what a dalifeed before this check wrote
    torch.save(saved, run / "last.pt")
    resumed = CliRunner().invoke(train_cli, ["--resume", str(run), "--epochs", "2"])
    assert resumed.exit_code == 0, resumed.output
    assert [line for line in resumed.output.splitlines() if "does not record the shards" in line] == [
        f"warning: {run}/last.pt does not record the shards it trained on (an older dalifeed wrote it): resuming "
        f"without checking that --data still holds them"]


def test_changes_are_found_in_each_mixed_dataset_and_split():
    """Several --data: each dataset's splits are compared with what it held, in the order given."""
    a = {"location": "/data/a", "splits": {"train": [["t0.tar", "aa"], ["t1.tar", "bb"]], "val": [["v0.tar", "cc"]]}}
    b = {"location": "s3://bucket/b", "splits": {"train": [["t0.tar", "dd"]]}}
    assert data_changes([a, b], [a, b]) == []
    reindexed = {"location": "/data/a", "splits": {"train": [["t0.tar", "aa", "i0"], ["t1.tar", "bb", "i9"]]}}
    indexed = {"location": "/data/a", "splits": {"train": [["t0.tar", "aa", "i0"], ["t1.tar", "bb", "i1"]]}}
    assert data_changes([indexed], [reindexed]) == [  # the same tars, indexed again: positions moved
        "split 'train' of /data/a: 2 shards then, 2 now, 1 changed or gone, 0 added (e.g. t1.tar indexed again (its "
        "index differs))"]
    turned = {"location": "/data/a", "splits": {"train": list(reversed(indexed["splits"]["train"]))}}
    assert data_changes([indexed], [turned]) == ["split 'train' of /data/a: 2 shards then, 2 now, the same shards in "
                                                 "another order"]
    b_now = {"location": "s3://bucket/b", "splits": {"train": [["t0.tar", "ee"], ["t1.tar", "ff"]]}}
    a_now = {**a, "splits": {**a["splits"], "val": []}}
    assert data_changes([a, b], [a_now, b_now]) == [
        "split 'val' of /data/a: 1 shards then, 0 now, 1 changed or gone, 0 added (e.g. v0.tar gone)",
        "split 'train' of s3://bucket/b: 1 shards then, 2 now, 1 changed or gone, 1 added (e.g. t0.tar sha256 dd... "
        "now ee...)"]


def test_a_folder_in_a_store_names_its_shards_as_its_manifest_does(s3_bucket, source, tmp_path):
    from test_s3 import convert_to

    url = f"{s3_bucket}/data"
    assert convert_to(source, url, "--samples-per-shard", "10").exit_code == 0
    local = convert(source, tmp_path / "local", seed=0)
    assert (open_dataset(url).contents(["train"])[0]["splits"]
            == open_dataset(str(local)).contents(["train"])[0]["splits"])
    assert open_dataset(url).contents(["train"])[0]["location"] == url
